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


def variants(features=None):
    from rnnify.kernels import scan, window_attn
    from rnnify.kernels.delta_rule import chunk as delta_chunk
    from rnnify.kernels.delta_rule import fused_recurrent as delta_recurrent
    from rnnify.kernels.linear_attn import chunk, common, fused_recurrent

    P = "*fp32"
    la = dict(
        q=P, k=P, v=P, g=P, gk=P, w=P, h0=P, km="*i8", o=P, ht=P, scale="fp32", fsqrt="fp32", fshift="fp32", T="i32"
    )
    lb = dict(q=P, k=P, v=P, g=P, gk=P, h0=P, do=P, dht=P, dq=P, dk=P, dv=P, dh0=P, scale="fp32", T="i32")
    # (feature map, K, F): the identity at K = 64, and the fused maps at d = 64 with their default
    # sizes (hedgehog 2d, performer d ln d = 266) and hedgehog at d = 128 (F = 256); the backward
    # kernels see F wide inputs. Every gate combination for the widest maps (rnnify.cells.linear's
    # KERNEL_MAX_FEATURES rests on them), the scalar gate for the others.
    maps = [
        ("identity", 64, 64),
        ("elu", 64, 64),
        ("hedgehog", 64, 128),
        ("hedgehog", 128, 256),
        ("performer", 64, 266),
    ]
    for feature, K, F in maps:
        if features is not None and F not in features:
            continue
        for use_g, use_gk in ((False, False), (True, False), (False, True), (True, True)):
            if feature not in ("identity", "performer") and K != 128 and (use_g, use_gk) != (True, False):
                continue
            BF = 1 << (F - 1).bit_length()
            sizes = dict(H=8, HKV=2, G=4, K=K, F=F, V=64, BK=K, BF=BF, BV=common.value_block(BF, 64))
            flags = dict(USE_G=use_g, USE_GK=use_gk, USE_INITIAL_STATE=True, USE_MASK=True)
            c = dict(**sizes, FEATURE=feature, QUERY_SHIFT=feature == "performer", **flags)
            yield fused_recurrent.fused_recurrent_linear_attn_fwd_kernel, la, c, {}
            BT = chunk.block_sizes(F, 64, use_gk)[0]
            c2 = {**c, "BT": BT, "PRECISION": "tf32"}
            yield chunk.chunk_linear_attn_fwd_kernel, la, c2, dict(num_warps=4, num_stages=1)
            cb = dict(
                B=2, H=8, HKV=2, G=4, K=F, V=64, BK=BF, BV=c["BV"], USE_G=use_g, USE_GK=use_gk, USE_INITIAL_STATE=True
            )
            yield fused_recurrent.fused_recurrent_linear_attn_bwd_kernel, lb, cb, {}
            yield (
                chunk.chunk_linear_attn_bwd_kernel,
                lb,
                {**cb, "BT": BT, "PRECISION": "tf32"},
                dict(num_warps=4, num_stages=1),
            )
    # delta rule at d = 64 and d = 128, gated and not (the backward holds all of K and V)
    da = dict(q=P, k=P, v=P, beta=P, g=P, h0=P, o=P, ht=P, hs=P, scale="fp32", T="i32")
    db = dict(
        q=P, k=P, v=P, beta=P, g=P, hs=P, do=P, dht=P, dq=P, dk=P, dv=P, dbeta=P, dg=P, dh0=P, scale="fp32", T="i32"
    )
    for D in (64, 128):
        for use_g in (False, True):
            BT, BK, BV = delta_chunk.block_sizes(D, D)
            c = dict(H=8, HKV=2, G=4, K=D, V=D, BK=BK, USE_G=use_g, USE_INITIAL_STATE=True)
            recurrent = {name: kind for name, kind in da.items() if name != "hs"}
            yield delta_recurrent.fused_recurrent_delta_rule_fwd_kernel, recurrent, {**c, "BV": BV}, {}
            for store in (True, False):
                yield (
                    delta_chunk.chunk_delta_rule_fwd_kernel,
                    da,
                    {**c, "BT": BT, "BV": BV, "STORE_OUTPUT": not store, "STORE_STATES": store, "PRECISION": "tf32"},
                    dict(num_warps=4, num_stages=1),
                )
            yield (
                delta_chunk.chunk_delta_rule_bwd_kernel,
                db,
                {**c, "BT": BT, "BV": D, "PRECISION": "tf32"},
                dict(num_warps=4, num_stages=1),
            )
    for reverse in (False, True):
        yield (
            scan.linear_recurrence_fwd_kernel,
            dict(a=P, b=P, h0=P, x=P, ht=P, T="i32"),
            dict(D=64, BT=64, BD=64, REVERSE=reverse, USE_INITIAL_STATE=True),
            {},
        )
    yield (
        scan.aaren_scan_fwd_kernel,
        dict(s=P, v=P, m0=P, u0=P, w0=P, o=P, mt=P, ut=P, wt=P, T="i32"),
        dict(H=4, D=64, BT=32, BD=64, USE_INITIAL_STATE=True),
        {},
    )
    yield (
        scan.aaren_scan_bwd_kernel,
        {**dict.fromkeys("s v m0 u0 w0 do o dmt dwt dut ms us ds dv dm0 du0 dw0".split(), P), "T": "i32"},
        dict(B=2, H=4, D=64, BT=32, BD=64, USE_INITIAL_STATE=True),
        {},
    )
    yield (
        window_attn.window_attn_step_kernel,
        dict(q=P, keys=P, values=P, valid="*i8", o=P, mo=P, uo=P, scale="fp32", N="i32"),
        dict(H=8, HKV=2, G=4, K=64, V=64, BN=32, BK=64, BV=64),
        {},
    )
    wb = dict(q=P, keys=P, values=P, valid="*i8", o=P, do=P, dq=P, dkeys=P, dvalues=P, scale="fp32", N="i32")
    for G in (1, 4):
        yield (
            window_attn.window_attn_step_bwd_kernel,
            wb,
            dict(H=2 * G, HKV=2, G=G, BG=G, K=128, V=128, BN=16, BK=128, BV=128),
            {},
        )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", type=int, default=90)
    p.add_argument(
        "--features",
        type=int,
        nargs="+",
        metavar="F",
        help="of the linear-attention variants only those with these feature dims (64, 128, 256, 266); "
        "the other kernels are always compiled",
    )
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET: the interpreter does not compile", file=sys.stderr)
        return 2
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target, limit, ok = GPUTarget("cuda", args.arch, 32), SHARED_LIMIT.get(args.arch), True
    for fn, signature, constexprs, options in variants(None if args.features is None else set(args.features)):
        flags = {
            k: v
            for k, v in constexprs.items()
            if k.startswith(("USE", "STORE")) or k in ("F", "K", "BT", "BV", "REVERSE", "FEATURE")
        }
        try:
            src = ASTSource(fn, {**signature, **{k: "constexpr" for k in constexprs}}, constexprs)
            shared = triton.compile(src, target=target, options=options).metadata.shared
        except Exception as e:  # noqa: BLE001 - report every failure, then fail
            print(f"FAIL {fn.__name__} {flags}: {type(e).__name__}: {str(e)[-800:]}")
            ok = False
            continue
        fits = limit is None or shared <= limit
        ok &= fits
        print(
            f"{'ok  ' if fits else 'FAIL'} {fn.__name__} {flags} shared memory {shared} B"
            + ("" if fits else f" > {limit} B")
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
