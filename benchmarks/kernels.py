"""Time rnnify.kernels' ops: PyTorch reference vs Triton path, and scaled_dot_product_attention.

    python benchmarks/kernels.py [--batch 1 --heads 8 --kv-heads 2 --head-dim 64 --lengths 128 512 ...]

On CUDA both paths run (the Triton one is the op's default there). On CPU only the reference runs
(the Triton path would go through the interpreter, which measures nothing useful), so the numbers
exist everywhere; "triton_ms" is then null. Writes JSON, with machine info and the command line,
to benchmarks/results/kernels-<device>-<time>.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import rnnify.kernels as K  # noqa: E402
from rnnify.kernels import utils  # noqa: E402


def timeit(fn, device, warmup=2, repeat=5):
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    times.sort()
    return 1000 * times[len(times) // 2]


def both_paths(fn, device, **kw):
    """(reference ms, Triton ms or None)."""
    forced = utils.FORCE_TRITON
    try:
        if device.type == "cuda":
            # on CUDA the op picks Triton; the reference is reached by calling the op's reference
            utils.FORCE_TRITON = True
            triton_ms = timeit(fn, device, **kw)
            saved, utils.HAS_TRITON = utils.HAS_TRITON, False
            try:
                ref_ms = timeit(fn, device, **kw)
            finally:
                utils.HAS_TRITON = saved
            return ref_ms, triton_ms
        utils.FORCE_TRITON = False
        return timeit(fn, device, **kw), None
    finally:
        utils.FORCE_TRITON = forced


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 2048])
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = p.parse_args(argv)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    B, H, Hkv, D = args.batch, args.heads, args.kv_heads, args.head_dim
    rows = []
    for T in args.lengths:
        gen = torch.Generator().manual_seed(0)
        r = lambda *s: torch.randn(*s, generator=gen).to(device, dtype)  # noqa: E731
        q, k, v = r(B, T, H, D), r(B, T, Hkv, D), r(B, T, Hkv, D)
        g = F.logsigmoid(r(B, T, Hkv) + 4).float()
        gk = F.logsigmoid(r(B, T, Hkv, D) + 4).float()
        a, b = torch.rand(B, T, H * D, generator=gen).to(device), r(B, T, H * D)
        s = r(B, T, H).float()
        vv = r(B, T, H, D)
        cases = {
            "chunk_linear_attn": lambda: K.chunk_linear_attn(q, k, v),
            "chunk_linear_attn[g]": lambda: K.chunk_linear_attn(q, k, v, g=g),
            "chunk_linear_attn[gk]": lambda: K.chunk_linear_attn(q, k, v, gk=gk),
            "fused_recurrent_linear_attn": lambda: K.fused_recurrent_linear_attn(q, k, v),
            "fused_recurrent_linear_attn[gk]": lambda: K.fused_recurrent_linear_attn(q, k, v, gk=gk),
            "linear_recurrence": lambda: K.linear_recurrence(a, b),
            "linear_recurrence[reverse]": lambda: K.linear_recurrence(a, b, reverse=True),
            "aaren_scan": lambda: K.aaren_scan(s, vv),
            # decode: one token against a full window of T keys (ring of T slots, 4 sinks)
            "window_attn_step": lambda: K.window_attn_step(q[:, :1], k[:, :1], v[:, :1], ring_k, ring_v, length,
                                                           sink_k, sink_v),
        }
        ring_k, ring_v = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
        sink_k, sink_v = ring_k[:, :, :4].contiguous(), ring_v[:, :, :4].contiguous()
        length = torch.full((B,), 10 * T, dtype=torch.long, device=device)
        qs, ks, vs = (x.transpose(1, 2) for x in (q, k.repeat_interleave(H // Hkv, 2), v.repeat_interleave(H // Hkv, 2)))
        sdpa_ms = timeit(lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True), device, repeat=args.repeat)
        rows.append({"op": "sdpa(causal)", "T": T, "reference_ms": sdpa_ms, "triton_ms": None, "sdpa_ms": sdpa_ms})
        for name, fn in cases.items():
            ref_ms, triton_ms = both_paths(fn, device, repeat=args.repeat)
            rows.append({"op": name, "T": T, "reference_ms": ref_ms, "triton_ms": triton_ms, "sdpa_ms": sdpa_ms})
            print(f"T={T:6d} {name:34s} reference {ref_ms:9.3f} ms   triton "
                  f"{'-' if triton_ms is None else f'{triton_ms:9.3f} ms'}   sdpa {sdpa_ms:8.3f} ms")
    info = {
        "command": " ".join([sys.executable, *sys.argv]),
        "time": datetime.now(timezone.utc).isoformat(),
        "machine": {
            "platform": platform.platform(), "processor": platform.processor(), "python": platform.python_version(),
            "torch": torch.__version__, "triton": getattr(utils.triton, "__version__", None),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "cpu_threads": torch.get_num_threads(),
        },
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "note": None if device.type == "cuda" else "CPU: reference path only (Triton runs on CUDA)",
        "results": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"kernels-{device.type}-{datetime.now().strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(info, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
