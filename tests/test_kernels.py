"""rnnify.kernels: every Triton kernel against its naive reference, under TRITON_INTERPRET=1 on CPU.

The interpreter must be chosen before triton is imported, hence the environment line above the
imports. Output buffers of the Triton paths come from ``rnnify.kernels.utils.empty``, which these
tests fill with NaN, so a kernel that leaves memory unwritten fails.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch
import torch.nn.functional as F

try:
    import triton  # noqa: F401
except ImportError:  # pragma: no cover
    pytest.skip("triton is not installed: the kernels' Triton paths cannot be tested", allow_module_level=True)

import rnnify.kernels as K
from rnnify.cells.aaren import naive_recurrent_aaren
from rnnify.cells.gated import naive_recurrent_gated_attn
from rnnify.cells.linear import naive_recurrent_linear_attn as cells_naive_linear
from rnnify.cells.window import naive_recurrent_window_attn
from rnnify.kernels import utils
from rnnify.kernels.linear_attn import common

TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture(autouse=True)
def nan_buffers(monkeypatch):
    def empty(shape, device, dtype=torch.float32):
        return torch.full(shape, float("nan"), device=device, dtype=dtype)

    monkeypatch.setattr(utils, "empty", empty)


@pytest.fixture
def triton_path(monkeypatch):
    monkeypatch.setattr(utils, "FORCE_TRITON", True)


def close(actual, expected):
    torch.testing.assert_close(actual, expected, **TOL)


def make_attn(B, T, H, Hkv, Kd, V, gates, seed=0, state=True):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    q, k, v = r(B, T, H, Kd), r(B, T, Hkv, Kd) / Kd ** 0.5, r(B, T, Hkv, V)
    gates = gates.split("+")
    g = -torch.rand(B, T, Hkv, generator=gen) if "g" in gates else None
    gk = F.logsigmoid(r(B, T, Hkv, Kd) + 2) if "gk" in gates else None
    h0 = r(B, Hkv, Kd, V) if state else None
    return q, k, v, g, gk, h0


# --------------------------------------------------------------------------- references agree with rnnify.cells

@pytest.mark.parametrize("normalize", [False, True])
def test_naive_matches_cells_linear(normalize):
    B, T, H, Hkv, Kd, V = 2, 7, 4, 2, 8, 5
    q, k, v, _, _, _ = make_attn(B, T, H, Hkv, Kd, V, "")
    q, k = F.elu(q) + 1, F.elu(k) + 1
    S0, z0 = torch.rand(B, Hkv, Kd, V), torch.rand(B, Hkv, Kd)
    state = (S0, z0) if normalize else S0
    o, st = K.naive_recurrent_linear_attn(q, k, v, scale=1.0, initial_state=state, output_final_state=True,
                                          normalize=normalize)
    phi_q = q.reshape(B, T, Hkv, H // Hkv, Kd).permute(0, 2, 3, 1, 4)
    ref, S, z = cells_naive_linear(phi_q, k.transpose(1, 2), v.transpose(1, 2), S0, z0 if normalize else None)
    close(o, ref.permute(0, 3, 1, 2, 4).reshape(B, T, H, V))
    close(st[0] if normalize else st, S)
    if normalize:
        close(st[1], z)


@pytest.mark.parametrize("gates", ["g", "gk"])
def test_naive_matches_cells_gated(gates):
    B, T, H, Hkv, Kd, V = 2, 7, 4, 2, 8, 5
    q, k, v, g, gk, h0 = make_attn(B, T, H, Hkv, Kd, V, gates)
    o, S = K.naive_recurrent_linear_attn(q, k, v, g, gk, scale=1.0, initial_state=h0, output_final_state=True)
    log_a = g.transpose(1, 2)[..., None] if gates == "g" else gk.transpose(1, 2)
    phi_q = q.reshape(B, T, Hkv, H // Hkv, Kd).permute(0, 2, 3, 1, 4)
    ref, ref_S, _ = naive_recurrent_gated_attn(phi_q, k.transpose(1, 2), v.transpose(1, 2), log_a, h0)
    close(o, ref.permute(0, 3, 1, 2, 4).reshape(B, T, H, V))
    close(S, ref_S)


def test_naive_aaren_matches_cells():
    B, T, H, D = 2, 9, 3, 6
    s, v = torch.randn(B, T, H), torch.randn(B, T, H, D)
    o, (m, u, w) = K.naive_aaren_scan(s, v, output_final_state=True)
    m0 = torch.full((B, H, 1), float("-inf"))
    ref, rm, ru, rw = naive_recurrent_aaren(s.permute(0, 2, 1)[:, :, None], v.transpose(1, 2),
                                            m0, torch.zeros(B, H, 1), torch.zeros(B, H, 1, D))
    close(o, ref[:, :, 0].transpose(1, 2))
    close(m, rm[..., 0]), close(u, ru[..., 0]), close(w, rw[:, :, 0])


# --------------------------------------------------------------------------- linear attention kernels

# (B, T, H, H_kv, K, V): T = 1, T not a multiple of the chunk (16 with gk, else 64), GQA 1/2/4
SHAPES = [
    (1, 1, 2, 2, 16, 16),
    (2, 19, 4, 2, 16, 20),
    (2, 9, 4, 1, 64, 64),
    (1, 13, 2, 2, 64, 16),
]
GATES = ["", "g", "gk", "g+gk"]
OPS = [K.fused_recurrent_linear_attn, K.chunk_linear_attn]


def check_attn(op, shape, gates, normalize=False, state=True, seed=0):
    q, k, v, g, gk, h0 = make_attn(*shape, gates, seed=seed, state=state)
    if normalize:
        q, k = F.elu(q) + 1, F.elu(k) + 1
        h0 = None if h0 is None else (h0.abs(), torch.rand(h0.shape[:3]))
    ref, ref_h = K.naive_recurrent_linear_attn(q, k, v, g, gk, initial_state=h0, output_final_state=True,
                                               normalize=normalize)
    o, h = op(q, k, v, g, gk, initial_state=h0, output_final_state=True, normalize=normalize)
    close(o, ref)
    if normalize:
        close(h[0], ref_h[0]), close(h[1], ref_h[1])
    else:
        close(h, ref_h)
    assert op(q, k, v, g, gk, initial_state=h0, normalize=normalize)[1] is None


@pytest.mark.parametrize("op", OPS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_linear_attn_shapes(triton_path, op, shape):
    check_attn(op, shape, "g+gk")


@pytest.mark.parametrize("op", OPS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("gates", GATES)
@pytest.mark.parametrize("normalize", [False, True])
def test_linear_attn_options(triton_path, op, gates, normalize):
    check_attn(op, (2, 11, 4, 2, 16, 16), gates, normalize=normalize, state=gates != "g")


@pytest.mark.parametrize("gates", GATES)
def test_chunk_several_chunks(triton_path, gates):
    check_attn(K.chunk_linear_attn, (1, 70, 2, 1, 16, 16), gates)


@pytest.mark.parametrize("op", OPS, ids=lambda f: f.__name__)
def test_half_inputs_fp32_state(triton_path, op):
    q, k, v, g, gk, h0 = make_attn(1, 20, 2, 1, 16, 16, "g")
    q, k, v = q.half(), k.half(), v.half()
    ref, ref_h = K.naive_recurrent_linear_attn(q, k, v, g, initial_state=h0, output_final_state=True)
    o, h = op(q, k, v, g, initial_state=h0, output_final_state=True)
    assert o.dtype == torch.float16 and h.dtype == torch.float32
    torch.testing.assert_close(o, ref, rtol=1e-3, atol=1e-3)
    close(h, ref_h)


def test_ops_take_non_contiguous_inputs(triton_path):
    q, k, v, g, gk, h0 = make_attn(2, 11, 4, 2, 16, 16, "g+gk")
    ref = torch.ops.rnnify.chunk_linear_attn(q, k, v, g, gk, h0, 0.25)
    t = lambda x: x.transpose(0, 1).contiguous().transpose(0, 1)  # noqa: E731 - same values, other strides
    for op in (torch.ops.rnnify.chunk_linear_attn, torch.ops.rnnify.fused_recurrent_linear_attn):
        for a, b in zip(op(t(q), t(k), t(v), t(g), t(gk), h0.transpose(-1, -2).contiguous().transpose(-1, -2), 0.25), ref):
            close(a, b)


@pytest.mark.parametrize("gates", ["", "g+gk"])
def test_reference_path(gates):
    for op in OPS:
        check_attn(op, (2, 11, 4, 2, 16, 16), gates)


def check_gradients(shape, gates, normalize):
    q, k, v, g, gk, h0 = make_attn(*shape, gates)
    state = h0
    if normalize:
        q, k = F.elu(q) + 1, F.elu(k) + 1
        state = (h0.abs(), torch.rand(h0.shape[:3]))
    leaves = [x.requires_grad_() for x in (q, k, v, g, gk, *(state if normalize else (state,))) if x is not None]
    grads = []
    for fn in (K.naive_recurrent_linear_attn, K.chunk_linear_attn):
        o, h = fn(q, k, v, g, gk, initial_state=state, output_final_state=True, normalize=normalize)
        hs = h if normalize else (h,)
        loss = (o * torch.linspace(-1, 1, o.shape[-1])).sum() + sum((x * x).sum() for x in hs)
        grads.append(torch.autograd.grad(loss, leaves))
    for a, b in zip(*grads):
        # gate gradients are reverse cumulative sums whose terms cancel: entries near 0 keep the
        # rounding of the large terms, so the tolerance is relative to the tensor's largest entry
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * max(1.0, b.abs().max().item()))


@pytest.fixture
def no_reference(monkeypatch):
    """The Triton path, forward and backward, must not fall back on the PyTorch reference."""
    def fail(*args, **kwargs):
        raise AssertionError("the PyTorch reference ran on the Triton path")

    monkeypatch.setattr(common, "reference", fail)


@pytest.mark.parametrize("gates", GATES)
@pytest.mark.parametrize("normalize", [False, True])
def test_chunk_gradients(triton_path, no_reference, gates, normalize):
    check_gradients((2, 21, 4, 2, 16, 8), gates, normalize)


# several chunks of 64 (and 16 with gk), two value blocks (V = 80), T = 1, GQA 1 and 4
@pytest.mark.parametrize("shape", [(1, 70, 4, 1, 16, 80), (2, 1, 2, 2, 64, 16)], ids=str)
@pytest.mark.parametrize("gates", ["", "g", "g+gk"])
def test_chunk_gradients_shapes(triton_path, no_reference, shape, gates):
    check_gradients(shape, gates, normalize=False)


def test_chunk_gradients_reference_path():
    check_gradients((2, 21, 4, 2, 16, 8), "g+gk", normalize=True)


# --------------------------------------------------------------------------- scans

@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("T", [1, 37, 130])
@pytest.mark.parametrize("D", [5, pytest.param(70, marks=pytest.mark.slow)])  # 70: two feature blocks
def test_linear_recurrence(triton_path, reverse, T, D):
    a, b, x0 = torch.rand(2, T, D), torch.randn(2, T, D), torch.randn(2, D)
    for h0 in (None, x0):
        ref, ref_h = K.naive_linear_recurrence(a, b, h0, reverse, True)
        x, h = K.linear_recurrence(a, b, h0, reverse, True)
        close(x, ref), close(h, ref_h)


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("T", [1, 70])
def test_linear_recurrence_gradients(triton_path, reverse, T):
    a, b, x0 = torch.rand(2, T, 5), torch.randn(2, T, 5), torch.randn(2, 5)
    leaves = [x.requires_grad_() for x in (a, b, x0)]
    grads = []
    for fn in (K.naive_linear_recurrence, K.linear_recurrence):
        x, h = fn(a, b, x0, reverse, True)
        loss = (x * torch.linspace(-1, 1, T)[None, :, None]).sum() + (h * h).sum()
        grads.append(torch.autograd.grad(loss, leaves))
    for g1, g2 in zip(*grads):
        close(g2, g1)


def test_linear_recurrence_reverse_is_flipped_forward(triton_path):
    a, b = torch.rand(1, 100, 4), torch.randn(1, 100, 4)
    x, _ = K.linear_recurrence(a, b, reverse=True)
    y, _ = K.linear_recurrence(a.flip(1), b.flip(1))
    close(x, y.flip(1))


@pytest.mark.parametrize("T", [1, 37, 70])
@pytest.mark.parametrize("D", [6, pytest.param(70, marks=pytest.mark.slow)])
def test_aaren_scan(triton_path, T, D):
    B, H = 2, 2
    s, v = torch.randn(B, T, H) * 3, torch.randn(B, T, H, D)
    s[0, 0] = float("-inf")  # a padding token first: nothing read yet
    state = (torch.randn(B, H), torch.rand(B, H) + 0.5, torch.randn(B, H, D))
    for h0 in (None, state):
        ref, ref_h = K.naive_aaren_scan(s, v, h0, True)
        o, h = K.aaren_scan(s, v, h0, True)
        close(o, ref)
        for a, b in zip(h, ref_h):
            close(a, b)


def test_aaren_scan_gradients(triton_path):
    B, T, H, D = 2, 9, 2, 6
    s, v = torch.randn(B, T, H), torch.randn(B, T, H, D)
    state = (torch.randn(B, H), torch.rand(B, H) + 0.5, torch.randn(B, H, D))
    leaves = [x.requires_grad_() for x in (s, v, *state)]
    grads = []
    for fn in (K.naive_aaren_scan, K.aaren_scan):
        o, (m, u, w) = fn(s, v, state, True)
        loss = (o * torch.linspace(-1, 1, D)).sum() + (u * u).sum() + (w * w).sum()
        grads.append(torch.autograd.grad(loss, leaves))
    for a, b in zip(*grads):
        close(a, b)


# --------------------------------------------------------------------------- window attention decode step

@pytest.mark.parametrize("sinks", [0, 2])
@pytest.mark.parametrize("heads", [(2, 2), (4, 1)], ids=str)
@pytest.mark.parametrize("path", ["triton", "reference"])
def test_window_attn_step(monkeypatch, sinks, heads, path):
    monkeypatch.setattr(utils, "FORCE_TRITON", path == "triton")
    B, T, D, W = 2, 9, 16, 5
    H, Hkv = heads
    q, k, v = torch.randn(B, T, H, D), torch.randn(B, T, Hkv, D), torch.randn(B, T, Hkv, D)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, :3] = False  # left padding
    keys, values = torch.zeros(B, Hkv, W, D), torch.zeros(B, Hkv, W, D)
    sk, sv = torch.zeros(B, Hkv, sinks, D), torch.zeros(B, Hkv, sinks, D)
    length = torch.zeros(B, dtype=torch.long)
    ref, *ref_state = naive_recurrent_window_attn(
        q.reshape(B, T, Hkv, H // Hkv, D).permute(0, 2, 3, 1, 4), k.transpose(1, 2), v.transpose(1, 2),
        mask, keys, values, sk, sv, length, D ** -0.5)
    state, outs = (keys, values, sk, sv, length), []
    for t in range(T):
        o, state = K.window_attn_step(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], state[0], state[1], state[4],
                                      state[2], state[3], mask=mask[:, t:t + 1])
        outs.append(o)
    close(torch.cat(outs, 1), ref.permute(0, 3, 1, 2, 4).reshape(B, T, H, D))
    for a, b in zip(state, ref_state):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_window_attn_read_many_keys(triton_path):
    B, H, Hkv, N, D = 2, 4, 2, 70, 16  # several blocks of 32 keys
    q, keys, values = torch.randn(B, H, D), torch.randn(B, Hkv, N, D), torch.randn(B, Hkv, N, 24)
    valid = torch.rand(B, N) > 0.3
    valid[1] = False  # nothing to read: 0
    o = torch.ops.rnnify.window_attn_step(q, keys, values, valid, 0.25)
    close(o, K.naive_window_attn_read(q, keys, values, valid, 0.25))
    assert (o[1] == 0).all()


# --------------------------------------------------------------------------- export (fake impls)

class _Ops(torch.nn.Module):
    def forward(self, q, k, v, g, h0, a):
        o1, h1 = K.fused_recurrent_linear_attn(q, k, v, g=g, initial_state=h0, output_final_state=True)
        o2, h2 = K.chunk_linear_attn(q, k, v, g=g, initial_state=h0, output_final_state=True, normalize=False)
        x, hx = K.linear_recurrence(a, v[:, :, 0], reverse=True, output_final_state=True)
        o3, (m, u, w) = K.aaren_scan(q[..., 0], q, output_final_state=True)
        ring = k.new_zeros(k.shape[0], k.shape[2], 4, k.shape[3])
        o4, _ = K.window_attn_step(q[:, :1], k[:, :1], v[:, :1], ring, ring, torch.zeros(k.shape[0], dtype=torch.long))
        return o1 + o2, h1 + h2, x, hx, o3, m, u, w, o4


def test_export():
    q, k, v, g, _, h0 = make_attn(1, 5, 2, 1, 16, 16, "g")
    args = (q, k, v, g, h0, torch.rand(1, 5, 16))
    ep = torch.export.export(_Ops(), args)
    targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    for name in ("fused_recurrent_linear_attn", "chunk_linear_attn", "linear_recurrence", "aaren_scan",
                 "window_attn_step"):
        assert any(name in t for t in targets), (name, targets)
    for a, b in zip(ep.module()(*args), _Ops()(*args)):
        close(a, b)


# --------------------------------------------------------------------------- larger

@pytest.mark.slow
def test_kernels_compile_for_sm90():
    """What the interpreter cannot check: every kernel compiles to sm_90 and fits its shared memory."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-m", "rnnify.kernels.compile_check"], env=env,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout + run.stderr


@pytest.mark.slow
@pytest.mark.parametrize("op", OPS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("gates", GATES)
def test_linear_attn_long(triton_path, op, gates):
    check_attn(op, (2, 150, 8, 2, 64, 64), gates)
