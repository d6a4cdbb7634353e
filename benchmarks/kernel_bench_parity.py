"""kernel_bench.py --parity: backend="triton" against backend="reference" in fp32 with exact dots, on
small awkward cases (odd lengths, GQA, initial states, gates, fused feature maps, masks), comparing
outputs, final states and input gradients."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from kernel_bench_cases import dot_precision

import rnnify.kernels as K
from rnnify.kernels import utils

# (op, B, T, H, H_kv, D, options): odd lengths, GQA, initial states, gates, fused maps, masks
PARITY = [
    ("chunk_linear_attn", 2, 70, 4, 2, 64, {"state": True}),
    ("chunk_linear_attn", 1, 70, 2, 2, 64, {"gates": "g+gk", "normalize": True, "feature_map": "elu"}),
    ("chunk_linear_attn", 1, 37, 2, 1, 128, {"gates": "gk", "state": True}),
    ("chunk_linear_attn", 2, 70, 2, 2, 64, {"feature_map": "hedgehog", "normalize": True, "mask": True}),
    ("fused_recurrent_linear_attn", 2, 37, 4, 2, 64, {"gates": "g", "state": True}),
    (
        "fused_recurrent_linear_attn",
        2,
        37,
        2,
        2,
        128,
        {"gates": "gk", "normalize": True, "feature_map": "elu", "mask": True},
    ),
    ("fused_recurrent_linear_attn", 2, 1, 4, 4, 128, {"state": True}),
    ("linear_recurrence", 2, 70, 1, 1, 40, {}),
    ("linear_recurrence", 2, 70, 1, 1, 40, {"reverse": True}),
    ("aaren_scan", 2, 37, 3, 3, 70, {}),
    ("window_attn_step", 2, 1, 4, 2, 64, {"window": 37, "sinks": 2}),
    ("chunk_delta_rule", 2, 70, 4, 2, 64, {"state": True, "mask": True}),
    ("chunk_delta_rule", 1, 70, 2, 2, 128, {"gates": "g", "state": True}),
    ("fused_recurrent_delta_rule", 2, 37, 4, 2, 64, {"gates": "g", "state": True, "mask": True}),
]
PARITY_TOL = dict(rtol=1e-3, atol=1e-3)  # fp32 with exact dots: a bug is off by far more


def parity_scan(op, B, T, H, D, opts, r):
    if op == "linear_recurrence":
        x = {"a": torch.sigmoid(r(B, T, D)), "b": r(B, T, D), "initial_state": r(B, D)}

        def call(b, x):
            reverse = opts.get("reverse", False)
            return list(K.linear_recurrence(**x, reverse=reverse, output_final_state=True, backend=b))

        return x, call
    x = {"s": r(B, T, H), "v": r(B, T, H, D), "initial_state": (r(B, H), r(B, H).abs() + 0.5, r(B, H, D))}

    def call(b, x):
        o, state = K.aaren_scan(**x, output_final_state=True, backend=b)
        return [o, *state]

    return x, call


def parity_window(B, H, Hkv, D, opts, r):
    W, S = opts["window"], opts["sinks"]
    x = {
        "q": r(B, 1, H, D),
        "k": r(B, 1, Hkv, D),
        "v": r(B, 1, Hkv, D),
        "keys": r(B, Hkv, W, D),
        "values": r(B, Hkv, W, D),
        "sink_keys": r(B, Hkv, S, D),
        "sink_values": r(B, Hkv, S, D),
    }
    length = torch.tensor([W + S + 5, 3][:B], device=x["q"].device)  # one full window, one barely started

    def call(b, x):
        o, _, (m, u) = K.window_attn_step(**x, length=length, return_stats=True, backend=b)
        return [o, m, u]

    return x, call


def parity_delta(op, B, T, H, Hkv, D, opts, r):
    x = {
        "q": F.normalize(r(B, T, H, D), dim=-1),
        "k": F.normalize(r(B, T, Hkv, D), dim=-1),
        "v": r(B, T, Hkv, D),
        "beta": torch.sigmoid(r(B, T, Hkv)),
    }
    if "g" in opts.get("gates", ""):
        x["g"] = F.logsigmoid(r(B, T, Hkv) + 3)
    if opts.get("state"):
        x["initial_state"] = r(B, Hkv, D, D)
    mask = None
    if opts.get("mask"):  # left padding: the last sequence starts a third of the way in
        mask = torch.ones(B, T, dtype=torch.bool, device=x["q"].device)
        mask[-1, : T // 3] = False

    def call(b, x):
        return list(getattr(K, op)(**x, mask=mask, output_final_state=True, backend=b))

    return x, call


def parity_linear_attn(op, B, T, H, Hkv, D, opts, r):
    fmap, normalize = opts.get("feature_map"), opts.get("normalize", False)
    Fd = 2 * D if fmap == "hedgehog" else D
    gates = opts.get("gates", "").split("+")
    x = {"q": r(B, T, H, D), "k": r(B, T, Hkv, D) / D**0.5, "v": r(B, T, Hkv, D)}
    device = x["q"].device
    if "g" in gates:
        x["g"] = F.logsigmoid(r(B, T, Hkv) + 3)
    if "gk" in gates:
        x["gk"] = F.logsigmoid(r(B, T, Hkv, Fd) + 3)
    if fmap == "hedgehog":
        x["feature_weight"] = torch.eye(D, device=device) + 0.1 * r(Hkv, D, D)
    if opts.get("state"):
        x["initial_state"] = (r(B, Hkv, Fd, D).abs(), r(B, Hkv, Fd).abs()) if normalize else r(B, Hkv, Fd, D)
    mask = None
    if opts.get("mask"):  # left padding: the second sequence starts a third of the way in
        mask = torch.arange(T, device=device) >= torch.tensor([0, T // 3][:B], device=device)[:, None]

    def call(b, x):
        o, h = getattr(K, op)(**x, normalize=normalize, feature_map=fmap, mask=mask, output_final_state=True, backend=b)
        return [o, *(h if isinstance(h, tuple) else (h,))]

    return x, call


def parity_inputs(op, B, T, H, Hkv, D, opts, device):
    """(inputs, call(backend, inputs) -> outputs) of one parity case, seeded, fp32."""
    gen = torch.Generator(device).manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=gen, device=device)  # noqa: E731
    if op in ("linear_recurrence", "aaren_scan"):
        return parity_scan(op, B, T, H, D, opts, r)
    if op == "window_attn_step":
        return parity_window(B, H, Hkv, D, opts, r)
    if op in ("chunk_delta_rule", "fused_recurrent_delta_rule"):
        return parity_delta(op, B, T, H, Hkv, D, opts, r)
    return parity_linear_attn(op, B, T, H, Hkv, D, opts, r)


def leaf(t: torch.Tensor) -> torch.Tensor:
    return t.clone().requires_grad_()


def flat(x: dict) -> list[torch.Tensor]:
    return [t for v in x.values() for t in (v if isinstance(v, tuple) else (v,))]


def parity_case(op, B, T, H, Hkv, D, opts, device) -> dict:
    """Outputs, final states and input gradients of backend="triton" against backend="reference"."""
    row = {"op": op, "B": B, "T": T, "H": H, "H_kv": Hkv, "D": D, "options": opts}
    try:
        x, call = parity_inputs(op, B, T, H, Hkv, D, opts, device)
        results = []
        for backend in ("reference", "triton"):
            xs = {k: tuple(map(leaf, v)) if isinstance(v, tuple) else leaf(v) for k, v in x.items()}
            outs = call(backend, xs)
            gen = torch.Generator(device).manual_seed(1)
            loss = sum((o.float() * torch.randn(o.shape, generator=gen, device=device)).sum() for o in outs)
            results.append([o.detach() for o in outs] + list(torch.autograd.grad(loss, flat(xs), allow_unused=True)))
        pairs = [(a, b) for a, b in zip(*results) if a is not None and b is not None]
        row["max_abs_err"] = max(((a.float() - b.float()).abs().max().item() for a, b in pairs), default=0.0)
        for a, b in pairs:
            torch.testing.assert_close(b.float(), a.float(), **PARITY_TOL)
        row["status"] = "pass"
    except AssertionError as e:
        row.update(status="fail", error=str(e)[:500])
    except Exception as e:  # noqa: BLE001 - one broken case must not hide the others
        row.update(status="error", error=f"{type(e).__name__}: {e}"[:500])
    return row


def parity(device: torch.device, cases=PARITY) -> list[dict]:
    """Every case with exact fp32 dots and the kernels' output buffers filled with NaN first, as
    the tests/test_kernels*.py files do, so memory a kernel leaves unwritten fails the comparison."""
    empty = utils.empty
    utils.empty = lambda shape, device, dtype=torch.float32: torch.full(shape, float("nan"), device=device, dtype=dtype)
    try:
        with dot_precision("ieee"):
            return [parity_case(*case, device) for case in cases]
    finally:
        utils.empty = empty
