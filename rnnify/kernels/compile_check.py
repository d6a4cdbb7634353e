"""Compile every kernel for a GPU target without a GPU: ``python -m rnnify.kernels.compile_check``.

The interpreter (TRITON_INTERPRET=1) runs kernels with numpy and lets through what a real compile
rejects (shapes tl.dot refuses, layouts, shared memory beyond the device). This compiles each
kernel, in each of its constexpr variants, to cubin for ``--arch`` (default 90: H100/H200) with
the launch options the ops use, and checks the shared memory against the device limit. Needs
triton's bundled ptxas, no driver. Exit code 0 when all compile and fit, 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import sys

SHARED_LIMIT = {80: 166912, 86: 101376, 89: 101376, 90: 232448}  # bytes per block (opt-in max)


def variants():
    from rnnify.kernels import scan, window_attn
    from rnnify.kernels.linear_attn import chunk, fused_recurrent

    P = "*fp32"
    la = dict(q=P, k=P, v=P, g=P, gk=P, h0=P, o=P, ht=P, scale="fp32", T="i32")
    lb = dict(q=P, k=P, v=P, g=P, gk=P, h0=P, do=P, dht=P, dq=P, dk=P, dv=P, dh0=P, scale="fp32", T="i32")
    for use_g in (False, True):
        for use_gk in (False, True):
            c = dict(H=8, HKV=2, G=4, K=64, V=64, BK=64, BV=64, USE_G=use_g, USE_GK=use_gk, USE_INITIAL_STATE=True)
            yield fused_recurrent.fused_recurrent_linear_attn_fwd_kernel, la, c, {}
            c2 = {**c, "BT": 16 if use_gk else 64, "PRECISION": "tf32"}
            yield chunk.chunk_linear_attn_fwd_kernel, la, c2, dict(num_warps=4, num_stages=1)
            yield chunk.chunk_linear_attn_bwd_kernel, lb, {**c2, "B": 2}, dict(num_warps=4, num_stages=1)
    for reverse in (False, True):
        yield (scan.linear_recurrence_fwd_kernel, dict(a=P, b=P, h0=P, x=P, ht=P, T="i32"),
               dict(D=64, BT=64, BD=64, REVERSE=reverse, USE_INITIAL_STATE=True), {})
    yield (scan.aaren_scan_fwd_kernel, dict(s=P, v=P, m0=P, u0=P, w0=P, o=P, mt=P, ut=P, wt=P, T="i32"),
           dict(H=4, D=64, BT=32, BD=64, USE_INITIAL_STATE=True), {})
    yield (window_attn.window_attn_step_kernel, dict(q=P, keys=P, values=P, valid="*i8", o=P, scale="fp32", N="i32"),
           dict(H=8, HKV=2, G=4, K=64, V=64, BN=32, BK=64, BV=64), {})


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", type=int, default=90)
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET: the interpreter does not compile", file=sys.stderr)
        return 2
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target, limit, ok = GPUTarget("cuda", args.arch, 32), SHARED_LIMIT.get(args.arch), True
    for fn, signature, constexprs, options in variants():
        flags = {k: v for k, v in constexprs.items() if k.startswith("USE") or k in ("BT", "REVERSE")}
        try:
            src = ASTSource(fn, {**signature, **{k: "constexpr" for k in constexprs}}, constexprs)
            shared = triton.compile(src, target=target, options=options).metadata.shared
        except Exception as e:  # noqa: BLE001 - report every failure, then fail
            print(f"FAIL {fn.__name__} {flags}: {type(e).__name__}: {str(e)[-800:]}")
            ok = False
            continue
        fits = limit is None or shared <= limit
        ok &= fits
        print(f"{'ok  ' if fits else 'FAIL'} {fn.__name__} {flags} shared memory {shared} B"
              + ("" if fits else f" > {limit} B"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
