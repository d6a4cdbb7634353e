"""rnnify.kernels.delta_rule: the Triton kernels (TRITON_INTERPRET=1 on CPU) and the PyTorch chunked
reference against the naive loop, and the loop against a float64 loop written here.

Output buffers of the Triton paths are NaN-filled (``utils.empty`` patched), so a kernel that leaves
memory unwritten fails. The interpreter is slow (seconds a call): the default cases are few and
small, the rest are marked slow.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch
import torch.nn.functional as F

# every test here runs the Triton path: the whole file is skipped without triton (an extra, "rnnify[triton]")
pytest.importorskip("triton", reason="triton is not installed: the kernels' Triton paths cannot be tested")

from kernel_support import nan_buffers  # noqa: F401 - autouse

import rnnify.kernels as K
from rnnify.kernels import utils
from rnnify.kernels.delta_rule import chunk as chunk_module
from rnnify.kernels.delta_rule import chunk_delta_rule_reference
from rnnify.kernels.delta_rule import fused_recurrent as recurrent_module

OPS = [K.chunk_delta_rule, K.fused_recurrent_delta_rule]


@pytest.fixture
def triton_path(monkeypatch):
    """Triton forward and backward, and no PyTorch reference anywhere on the way."""
    monkeypatch.setattr(utils, "FORCE_TRITON", True)

    def fail(*args, **kwargs):
        raise AssertionError("the PyTorch reference ran on the Triton path")

    monkeypatch.setattr(chunk_module, "_reference", fail)
    monkeypatch.setattr(recurrent_module, "_reference", fail)


def make_inputs(B, T, H, Hkv, Kd, V, gated, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=dtype)  # noqa: E731
    q, k = F.normalize(r(B, T, H, Kd), dim=-1), F.normalize(r(B, T, Hkv, Kd), dim=-1)
    v = r(B, T, Hkv, V)
    beta = torch.rand(B, T, Hkv, generator=gen, dtype=dtype)
    g = F.logsigmoid(r(B, T, Hkv) + 3) if gated else None
    return q, k, v, beta, g, r(B, Hkv, Kd, V)


def float64_loop(q, k, v, beta, g, h0, scale):
    """The equations, one batch row / kv head / token at a time, in float64, with S = [d_v, d_k]:
    S_t = a_t S_{t-1} (I - b_t k_t k_t^T) + b_t v_t k_t^T, o_t = scale S_t q_t."""
    q, k, v, beta = q.double(), k.double(), v.double(), beta.double()
    B, T, H, Kd = q.shape
    Hkv = k.shape[2]
    out = torch.zeros(B, T, H, v.shape[-1], dtype=torch.float64)
    final = torch.zeros(B, Hkv, Kd, v.shape[-1], dtype=torch.float64)
    eye = torch.eye(Kd, dtype=torch.float64)
    for b in range(B):
        for h in range(Hkv):
            S = h0[b, h].double().T.clone()
            for t in range(T):
                a = 1.0 if g is None else float(torch.exp(g[b, t, h].double()))
                kt = k[b, t, h]
                S = a * S @ (eye - beta[b, t, h] * torch.outer(kt, kt)) + beta[b, t, h] * torch.outer(v[b, t, h], kt)
                for i in range(H // Hkv):
                    out[b, t, h * (H // Hkv) + i] = scale * S @ q[b, t, h * (H // Hkv) + i]
            final[b, h] = S.T
    return out, final


@pytest.mark.parametrize("gated", [False, True])
def test_naive_and_chunked_reference_match_float64_loop(gated):
    q, k, v, beta, g, h0 = make_inputs(2, 21, 4, 2, 6, 5, gated, dtype=torch.float64)
    ref_o, ref_h = float64_loop(q, k, v, beta, g, h0, 0.5)
    o, h = K.naive_recurrent_delta_rule(q, k, v, beta, g, 0.5, h0, output_final_state=True)
    assert o.dtype == torch.float64
    torch.testing.assert_close(o, ref_o, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(h, ref_h, rtol=1e-12, atol=1e-12)
    for chunk in (1, 4, 64):
        o, h = chunk_delta_rule_reference(q, k, v, beta, g, 0.5, h0, chunk_size=chunk)
        torch.testing.assert_close(o, ref_o, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(h, ref_h, rtol=1e-10, atol=1e-10)


def close_grad(actual, expected):
    # log-decay gradients are sums over the chunk whose terms cancel: tolerance relative to the largest entry
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-5 * max(1.0, expected.abs().max().item()))


def check_op(op, shape, gated, mask=None, state=True, grads=True):
    """Outputs, final state and gradients (q, k, v, beta, g, h0) against the naive loop."""
    q, k, v, beta, g, h0 = make_inputs(*shape, gated)
    h0 = h0 if state else None
    leaves = [x.requires_grad_() for x in (q, k, v, beta, g, h0) if x is not None]
    results = []
    for fn in (K.naive_recurrent_delta_rule, op):
        if fn is K.naive_recurrent_delta_rule and mask is not None:  # padding by hand: beta = 0, g = 0
            real = mask[:, :, None]
            o, h = fn(
                q,
                k,
                v,
                torch.where(real, beta, 0.0),
                None if g is None else torch.where(real, g, 0.0),
                initial_state=h0,
                output_final_state=True,
            )
        else:
            kw = {} if mask is None else {"mask": mask}
            o, h = fn(q, k, v, beta, g, initial_state=h0, output_final_state=True, **kw)
        assert torch.isfinite(o).all() and torch.isfinite(h).all()
        loss = (o * torch.linspace(-1, 1, o.shape[-1])).sum() + (h * h).sum()
        results.append((o, h, torch.autograd.grad(loss, leaves) if grads else ()))
    (ref_o, ref_h, ref_g), (o, h, dgrads) = results
    torch.testing.assert_close(o, ref_o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h, ref_h, rtol=1e-5, atol=1e-5)
    for a, b in zip(dgrads, ref_g):
        close_grad(a, b)
    if grads and mask is not None:  # padding: no gradient to its beta and g
        for d in dgrads[3 : 3 + gated]:
            assert (d[~mask] == 0).all()
    return dgrads


# Default cases: gated with GQA, left padding, a state to continue from and two chunks (BT = 32);
# ungated on the step kernel. Two value blocks (V = 80 > 64) and more shapes are slow.
def test_chunk_gated_padding_state(triton_path):
    mask = torch.ones(2, 37, dtype=torch.bool)
    mask[0, :6] = False
    check_op(K.chunk_delta_rule, (2, 37, 2, 1, 16, 16), gated=True, mask=mask)


def test_fused_recurrent_ungated(triton_path):
    mask = torch.ones(2, 5, dtype=torch.bool)
    mask[0, :2] = False
    check_op(K.fused_recurrent_delta_rule, (2, 5, 4, 2, 16, 16), gated=False, mask=mask)


@pytest.mark.parametrize("op", OPS, ids=lambda f: f.__name__)
def test_reference_path(op):
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1, :3] = False
    check_op(op, (2, 9, 4, 2, 8, 8), gated=True, mask=mask)


def test_half_inputs_fp32_state(triton_path):
    q, k, v, beta, g, h0 = make_inputs(1, 6, 2, 1, 16, 16, True)
    ref, ref_h = K.naive_recurrent_delta_rule(
        q.half(), k.half(), v.half(), beta, g, initial_state=h0, output_final_state=True
    )
    o, h = K.fused_recurrent_delta_rule(
        q.half(), k.half(), v.half(), beta, g, initial_state=h0, output_final_state=True
    )
    assert o.dtype == torch.float16 and h.dtype == torch.float32
    torch.testing.assert_close(o, ref, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(h, ref_h, rtol=1e-5, atol=1e-5)


def test_bad_inputs():
    q, k, v, beta, g, _ = make_inputs(1, 4, 2, 1, 8, 8, True)
    with pytest.raises(ValueError, match="beta must be"):
        K.chunk_delta_rule(q, k, v, beta[:, :3], backend="reference")
    with pytest.raises(ValueError, match="mask must be"):
        K.chunk_delta_rule(q, k, v, beta, g, mask=torch.ones(1, 3, dtype=torch.bool), backend="reference")
    for op in (K.chunk_delta_rule, K.fused_recurrent_delta_rule):  # a state the kernel would read past
        with pytest.raises(ValueError, match=r"initial_state must be \[1, 1, 8, 8\], got \[1, 1, 8, 16\]"):
            op(q, k, v, beta, g, initial_state=torch.zeros(1, 1, 8, 16), backend="reference")


def test_export():
    q, k, v, beta, g, h0 = make_inputs(1, 5, 2, 1, 16, 8, True)

    class Ops(torch.nn.Module):
        def forward(self, q, k, v, beta, g, h0):
            o1, h1 = K.chunk_delta_rule(q, k, v, beta, g, initial_state=h0, output_final_state=True)
            o2, h2 = K.fused_recurrent_delta_rule(q, k, v, beta, initial_state=h0, output_final_state=True)
            return o1 + o2, h1 + h2

    args = (q, k, v, beta, g, h0)
    ep = torch.export.export(Ops(), args)
    targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert any("chunk_delta_rule" in t for t in targets) and any("fused_recurrent_delta_rule" in t for t in targets)
    for a, b in zip(ep.module()(*args), Ops()(*args)):
        torch.testing.assert_close(a, b)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_opcheck(monkeypatch, backend):
    """torch.library.opcheck: schemas, fake impls, autograd registration, the traced backward."""
    monkeypatch.setattr(utils, "FORCE_TRITON", backend == "triton")
    q, k, v, beta, g, h0 = make_inputs(1, 5, 2, 1, 16, 8, True)
    for op in (torch.ops.rnnify.chunk_delta_rule, torch.ops.rnnify.fused_recurrent_delta_rule):
        torch.library.opcheck(
            op, [x.clone().requires_grad_() for x in (q, k, v, beta, g, h0)] + [0.25], {"backend": backend}
        )


@pytest.mark.slow
@pytest.mark.parametrize("op", OPS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize(
    "shape", [(1, 1, 2, 2, 16, 16), (2, 70, 4, 2, 16, 80), (1, 40, 2, 1, 64, 64), (1, 33, 2, 2, 128, 32)], ids=str
)
def test_ops_shapes(triton_path, op, gated, shape):
    mask = torch.ones(shape[:2], dtype=torch.bool)
    mask[-1, : shape[1] // 3] = False
    check_op(op, shape, gated, mask=mask, state=shape[1] != 70)


@pytest.mark.slow
@pytest.mark.parametrize("gated", [False, True])
def test_long_sequence_is_stable(gated):
    """100k tokens: the chunked form stays finite and equal to the token loop, and the state stays
    on the scale of the values written (unit keys, beta < 1, alpha <= 1)."""
    q, k, v, beta, g, _ = make_inputs(1, 100_000, 2, 1, 16, 16, gated)
    o, h = K.chunk_delta_rule(q, k, v, beta, g, output_final_state=True, backend="reference")
    ref_o, ref_h = K.naive_recurrent_delta_rule(q, k, v, beta, g, output_final_state=True)
    assert torch.isfinite(o).all() and torch.isfinite(h).all()
    torch.testing.assert_close(h, ref_h, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(o[0, -1000:], ref_o[0, -1000:], rtol=1e-3, atol=1e-3)
    assert h.norm(dim=-1).max() < 4 * v.norm(dim=-1).max()


@pytest.mark.slow
@pytest.mark.parametrize("gated", [False, True])
def test_100k_decode_steps_are_stable(gated):
    """100k decode steps, each ``fused_recurrent_delta_rule`` on one token from the state the last
    one left: finite, the state on the scale of the values written, and equal to one chunked pass."""
    q, k, v, beta, g, _ = make_inputs(1, 100_000, 2, 1, 16, 16, gated)
    _, ref_h = K.chunk_delta_rule(q, k, v, beta, g, output_final_state=True, backend="reference")
    h, outs = None, []
    for t in range(q.shape[1]):
        step = slice(t, t + 1)
        o, h = K.fused_recurrent_delta_rule(
            q[:, step],
            k[:, step],
            v[:, step],
            beta[:, step],
            None if g is None else g[:, step],
            initial_state=h,
            output_final_state=True,
            backend="reference",
        )
        outs.append(o)
    assert torch.isfinite(torch.cat(outs, 1)).all() and torch.isfinite(h).all()
    torch.testing.assert_close(h, ref_h, rtol=1e-3, atol=1e-3)
    assert h.norm(dim=-1).max() < 4 * v.norm(dim=-1).max()
