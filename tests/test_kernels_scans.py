"""rnnify.kernels' scans (the linear recurrence, Aaren's) and the window attention decode step:
the Triton kernels under TRITON_INTERPRET=1 on CPU against their naive references, forward and
backward. Output buffers of the Triton paths are NaN-filled (``kernel_support.nan_buffers``), so a
kernel that leaves memory unwritten fails.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

# every test here runs the Triton path: the whole file is skipped without triton (an extra, "rnnify[triton]")
pytest.importorskip("triton", reason="triton is not installed: the kernels' Triton paths cannot be tested")

from kernel_support import close, close_grad, nan_buffers, triton_path  # noqa: F401 - fixtures, nan_buffers autouse

import rnnify.kernels as K
from rnnify.cells.window import naive_recurrent_window_attn
from rnnify.kernels import scan, utils

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


@pytest.mark.parametrize("T", [1, 37])  # 37: two chunks of 32, the second partial
@pytest.mark.parametrize("D", [6, pytest.param(70, marks=pytest.mark.slow)])  # 70: two feature blocks
@pytest.mark.parametrize("scores", ["distinct", "ties"])
def test_aaren_scan_gradients(triton_path, monkeypatch, T, D, scores):
    """Triton backward vs autograd of the loop, with and without an initial state; "ties": equal
    scores (and -inf padding), where the max's gradient splits as torch.maximum's does."""
    B, H = 2, 2
    gen = torch.Generator().manual_seed(T + D)
    s = torch.randn(B, T, H, generator=gen) * 3
    m0 = torch.randn(B, H, generator=gen)
    if scores == "ties":
        s, m0 = s.round().clamp(-2, 2), m0.round()
        s[0, 0] = float("-inf")
    v = torch.randn(B, T, H, D, generator=gen)
    for state in (None, (m0, torch.rand(B, H, generator=gen) + 0.5, torch.randn(B, H, D, generator=gen))):
        leaves = [x.requires_grad_() for x in (s, v, *(state or ()))]
        grads = []
        for fn in (K.naive_aaren_scan, K.aaren_scan):
            with monkeypatch.context() as patch:
                if fn is K.aaren_scan:  # the Triton path must not run the loop
                    patch.setattr(scan, "naive_aaren_scan", None)
                o, (m, u, w) = fn(s, v, state, True)
                loss = (o * torch.linspace(-1, 1, D)).sum() + (m * torch.arange(H)).sum()
                loss = loss + (u * u).sum() + (w * w).sum()
                grads.append(torch.autograd.grad(loss, leaves))
        for a, b in zip(*grads):
            close_grad(b, a)


def test_aaren_scan_gradients_reference_path():
    B, T, H, D = 2, 9, 2, 6
    s, v = torch.randn(B, T, H), torch.randn(B, T, H, D)
    state = (torch.randn(B, H), torch.rand(B, H) + 0.5, torch.randn(B, H, D))
    leaves = [x.requires_grad_() for x in (s, v, *state)]
    grads = []
    for fn in (K.naive_aaren_scan, K.aaren_scan):
        o, (m, u, w) = fn(s, v, state, True)
        grads.append(torch.autograd.grad((o * torch.linspace(-1, 1, D)).sum() + (w * w).sum(), leaves))
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
        q.reshape(B, T, Hkv, H // Hkv, D).permute(0, 2, 3, 1, 4),
        k.transpose(1, 2),
        v.transpose(1, 2),
        mask,
        keys,
        values,
        sk,
        sv,
        length,
        D**-0.5,
    )
    state, outs = (keys, values, sk, sv, length), []
    for t in range(T):
        o, state = K.window_attn_step(
            q[:, t : t + 1],
            k[:, t : t + 1],
            v[:, t : t + 1],
            state[0],
            state[1],
            state[4],
            state[2],
            state[3],
            mask=mask[:, t : t + 1],
        )
        outs.append(o)
    close(torch.cat(outs, 1), ref.permute(0, 3, 1, 2, 4).reshape(B, T, H, D))
    for a, b in zip(state, ref_state):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_window_attn_read_many_keys(triton_path):
    B, H, Hkv, N, D = 2, 4, 2, 70, 16  # several blocks of 32 keys
    q, keys, values = torch.randn(B, H, D), torch.randn(B, Hkv, N, D), torch.randn(B, Hkv, N, 24)
    valid = torch.rand(B, N) > 0.3
    valid[1] = False  # nothing to read: 0
    o, m, u = torch.ops.rnnify.window_attn_step(q, keys, values, valid, 0.25)
    ref = K.naive_window_attn_read(q, keys, values, valid, 0.25, stats=True)
    for a, b in zip((o, m, u), ref):
        close(a, b)
    assert (o[1] == 0).all() and (u[1] == 0).all() and (m[1] == float("-inf")).all()


# GQA 1 / 2 / 4, head dims 16 / 64 / 128, N = 37 keys (blocks of 16 in the backward, 32 forward)
@pytest.mark.parametrize("heads", [(2, 2), (4, 2), (4, 1)], ids=str)
@pytest.mark.parametrize("D", [16, 64, 128])
def test_window_attn_read_gradients(triton_path, heads, D):
    H, Hkv = heads
    B, N, V = 2, 37, 24
    q, keys, values = torch.randn(B, H, D), torch.randn(B, Hkv, N, D), torch.randn(B, Hkv, N, V)
    valid = torch.rand(B, N) > 0.3
    valid[1] = False  # nothing to read: 0, and no gradient
    leaves = [x.requires_grad_() for x in (q, keys, values)]
    grads = []
    for fn in (K.naive_window_attn_read, lambda *args: torch.ops.rnnify.window_attn_step(*args)[0]):
        o = fn(q, keys, values, valid, 0.25)
        grads.append(torch.autograd.grad((o * torch.linspace(-1, 1, V)).sum(), leaves))
    for a, b in zip(*grads):
        close_grad(b, a)
    assert (grads[1][0][1] == 0).all()


@pytest.mark.parametrize("path", ["triton", "reference"])
def test_window_attn_step_gradients(path):
    """Through the step's writes: gradients reach q, the new k / v, the ring and the sinks."""
    B, H, Hkv, D, W, S = 2, 4, 2, 16, 5, 2
    q, k, v = torch.randn(B, 1, H, D), torch.randn(B, 1, Hkv, D), torch.randn(B, 1, Hkv, D)
    keys, values = torch.randn(B, Hkv, W, D), torch.randn(B, Hkv, W, D)
    sk, sv = torch.randn(B, Hkv, S, D), torch.randn(B, Hkv, S, D)
    length = torch.tensor([3, 9])  # batch 0 still fills its sinks' slots, batch 1 wraps the ring
    leaves = [x.requires_grad_() for x in (q, k, v, keys, values, sk, sv)]
    grads = []
    for backend in ("reference", path):
        o, state = K.window_attn_step(q, k, v, keys, values, length, sk, sv, backend=backend)
        loss = (o * torch.linspace(-1, 1, D)).sum() + sum((x * x).sum() for x in state[:4])
        grads.append(torch.autograd.grad(loss, leaves))
    for a, b in zip(*grads):
        close_grad(b, a)


@pytest.mark.parametrize("path", ["triton", "reference"])
def test_window_attn_step_stats(path):
    """return_stats: the max and denominator of the softmax (o u = the unnormalised sum), and their
    gradients (added to o's) against autograd through the naive read."""
    B, H, Hkv, D, W = 2, 4, 2, 16, 5
    q, k, v = torch.randn(B, 1, H, D), torch.randn(B, 1, Hkv, D), torch.randn(B, 1, Hkv, D)
    keys, values = torch.randn(B, Hkv, W, D), torch.randn(B, Hkv, W, D)
    length = torch.tensor([2, 9])
    leaves = [x.requires_grad_() for x in (q, k, v, keys, values)]
    results = []
    for backend in ("reference", path):
        o, state, (m, u) = K.window_attn_step(q, k, v, keys, values, length, return_stats=True, backend=backend)
        assert m.shape == u.shape == (B, 1, H)
        loss = (o * u[..., None] * torch.linspace(-1, 1, D)).sum() + (m * torch.linspace(0.5, 2, H)).sum()
        results.append(((o, m, u), torch.autograd.grad(loss, leaves)))
    (ref, ref_grads), (out, grads) = results
    for a, b in zip(out, ref):
        close(a, b)
    for a, b in zip(grads, ref_grads):
        close_grad(a, b)
    # against the read by hand: m = max of the scores over the held keys, u = sum exp(s - m)
    s = torch.einsum("bhgk,bhnk->bhgn", q[:, 0].detach().reshape(B, Hkv, 2, D), state[0][:, :, :3].detach()) * D**-0.5
    close(out[1][0, 0], s[0].amax(-1).reshape(H))
    close(out[2][0, 0], torch.exp(s[0] - s[0].amax(-1, keepdim=True)).sum(-1).reshape(H))
