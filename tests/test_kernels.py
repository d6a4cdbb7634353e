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

# every test here runs the Triton path: the whole file is skipped without triton (an extra, "rnnify[triton]")
pytest.importorskip("triton", reason="triton is not installed: the kernels' Triton paths cannot be tested")

from kernel_support import nan_buffers  # noqa: F401 - autouse

import rnnify.kernels as K
from rnnify.cells.aaren import naive_recurrent_aaren
from rnnify.cells.linear import naive_recurrent_feature_attn
from rnnify.cells.window import naive_recurrent_window_attn
from rnnify.errors import RnnifyError
from rnnify.kernels import scan, utils
from rnnify.kernels.linear_attn import common
from rnnify.kernels.linear_attn.naive import naive_recurrent_gated_attn

TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture
def triton_path(monkeypatch):
    monkeypatch.setattr(utils, "FORCE_TRITON", True)


def close(actual, expected):
    torch.testing.assert_close(actual, expected, **TOL)


def make_attn(B, T, H, Hkv, Kd, V, gates, seed=0, state=True):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    q, k, v = r(B, T, H, Kd), r(B, T, Hkv, Kd) / Kd**0.5, r(B, T, Hkv, V)
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
    o, st = K.naive_recurrent_linear_attn(
        q, k, v, scale=1.0, initial_state=state, output_final_state=True, normalize=normalize
    )
    phi_q = q.reshape(B, T, Hkv, H // Hkv, Kd).permute(0, 2, 3, 1, 4)
    ref, S, z = naive_recurrent_feature_attn(phi_q, k.transpose(1, 2), v.transpose(1, 2), S0, z0 if normalize else None)
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
    ref, rm, ru, rw = naive_recurrent_aaren(
        s.permute(0, 2, 1)[:, :, None], v.transpose(1, 2), m0, torch.zeros(B, H, 1), torch.zeros(B, H, 1, D)
    )
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
    ref, ref_h = K.naive_recurrent_linear_attn(
        q, k, v, g, gk, initial_state=h0, output_final_state=True, normalize=normalize
    )
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
        for a, b in zip(
            op(t(q), t(k), t(v), t(g), t(gk), h0.transpose(-1, -2).contiguous().transpose(-1, -2), 0.25), ref
        ):
            close(a, b)


@pytest.mark.parametrize("gates", ["", "g+gk"])
def test_reference_path(gates):
    for op in OPS:
        check_attn(op, (2, 11, 4, 2, 16, 16), gates)


def close_grad(actual, expected):
    # gate gradients are reverse cumulative sums whose terms cancel: entries near 0 keep the
    # rounding of the large terms, so the tolerance is relative to the tensor's largest entry
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5 * max(1.0, expected.abs().max().item()))


def check_gradients(op, shape, gates, normalize):
    q, k, v, g, gk, h0 = make_attn(*shape, gates)
    state = h0
    if normalize:
        q, k = F.elu(q) + 1, F.elu(k) + 1
        state = (h0.abs(), torch.rand(h0.shape[:3]))
    leaves = [x.requires_grad_() for x in (q, k, v, g, gk, *(state if normalize else (state,))) if x is not None]
    grads = []
    for fn in (K.naive_recurrent_linear_attn, op):
        o, h = fn(q, k, v, g, gk, initial_state=state, output_final_state=True, normalize=normalize)
        hs = h if normalize else (h,)
        loss = (o * torch.linspace(-1, 1, o.shape[-1])).sum() + sum((x * x).sum() for x in hs)
        grads.append(torch.autograd.grad(loss, leaves))
    for a, b in zip(*grads):
        close_grad(b, a)


@pytest.fixture
def no_reference(monkeypatch):
    """The Triton path, forward and backward, must not fall back on the PyTorch reference."""

    def fail(*args, **kwargs):
        raise AssertionError("the PyTorch reference ran on the Triton path")

    monkeypatch.setattr(common, "reference", fail)


@pytest.mark.parametrize("op", OPS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("gates", GATES)
@pytest.mark.parametrize("normalize", [False, True])
def test_linear_attn_gradients(triton_path, no_reference, op, gates, normalize):
    check_gradients(op, (2, 21, 4, 2, 16, 8), gates, normalize)


# two value blocks (V = 80; for chunk several chunks of 64, and of 16 with gk), T = 1, GQA 1 / 2 / 4, K 16 / 64 / 128
GRAD_SHAPES = [(K.chunk_linear_attn, (1, 70, 4, 1, 16, 80)), (K.fused_recurrent_linear_attn, (1, 13, 4, 1, 16, 80))]
GRAD_SHAPES += [(op, shape) for op in OPS for shape in [(2, 1, 2, 2, 64, 16), (2, 9, 4, 2, 128, 16)]]


@pytest.mark.parametrize("op, shape", GRAD_SHAPES, ids=lambda x: getattr(x, "__name__", str(x)))
@pytest.mark.parametrize("gates", ["", "g+gk"])
def test_linear_attn_gradients_shapes(triton_path, no_reference, op, shape, gates):
    check_gradients(op, shape, gates, normalize=False)


@pytest.mark.parametrize("op", OPS, ids=lambda f: f.__name__)
def test_linear_attn_gradients_reference_path(op):
    check_gradients(op, (2, 21, 4, 2, 16, 8), "g+gk", normalize=True)


# --------------------------------------------------------------------------- fused feature maps


def check_feature_map(op, name, normalize, shape, options):
    """The fused map reproduces rnnify.cells.linear's phi (performer: its stabilised queries when
    normalised) in the forward, and the backward reaches q, k and the weight."""
    from rnnify.cells.base import CellSpec
    from rnnify.cells.linear import build_feature_map

    B, T, H, Hkv, D, V = shape
    spec = CellSpec(num_heads=H, num_kv_heads=Hkv, head_dim=D, value_dim=V, scale=0.3)
    phi = build_feature_map(name, spec, **options)
    if name in ("hedgehog", "performer"):  # random (hedgehog starts at the identity), and a leaf
        phi.weight = torch.nn.Parameter(torch.randn(phi.weight.shape, generator=torch.Generator().manual_seed(1)))
    Fd = phi.feature_dim
    q, k, v, g, _, _ = make_attn(B, T, H, Hkv, D, V, "g")
    gk = F.logsigmoid(torch.randn(B, T, Hkv, Fd) + 2)  # per feature
    state = torch.rand(B, Hkv, Fd, V), torch.rand(B, Hkv, Fd)
    state = state if normalize else state[0]
    weight = getattr(phi, "weight", None)
    leaves = [x.requires_grad_() for x in (q, k, v, g, gk, *(state if normalize else (state,)))]
    leaves += [weight] if weight is not None else []

    grouped = q.reshape(B, T, Hkv, H // Hkv, D).permute(0, 2, 3, 1, 4)
    phi_q = (phi.normalised_query(grouped) if normalize else phi(grouped)).permute(0, 3, 1, 2, 4).reshape(B, T, H, Fd)
    phi_k = phi(k.transpose(1, 2)).transpose(1, 2)
    ref = K.naive_recurrent_linear_attn(
        phi_q, phi_k, v, g, gk, scale=1.0, initial_state=state, output_final_state=True, normalize=normalize
    )
    out = op(
        q,
        k,
        v,
        g,
        gk,
        scale=spec.scale,
        initial_state=state,
        output_final_state=True,
        normalize=normalize,
        feature_map=name,
        feature_weight=weight,
    )
    grads = []
    for o, h in (ref, out):
        hs = h if normalize else (h,)
        loss = (o * torch.linspace(-1, 1, V)).sum() + sum((x * x).sum() for x in hs)
        grads.append(torch.autograd.grad(loss, leaves))
    close(out[0], ref[0])
    for a, b in zip(*grads):
        close_grad(b, a)


@pytest.mark.parametrize("op", OPS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("name", ["elu", "relu", "hedgehog", "performer"])
@pytest.mark.parametrize("normalize", [False, True])
def test_feature_maps_match_cells(triton_path, no_reference, op, name, normalize):
    options = {"hedgehog": {"feature_dim": 24}, "performer": {"num_features": 20}}.get(name, {})  # F: no power of 2
    check_feature_map(op, name, normalize, (2, 11, 4, 2, 16, 8), options)


def test_feature_map_reference_path():
    """backend="reference" featurises in PyTorch and agrees with the Triton path."""
    q, k, v, _, _, _ = make_attn(1, 7, 2, 1, 16, 8, "")
    w = torch.randn(1, 16, 6)
    for name in ("hedgehog", "performer"):
        outs = [
            K.chunk_linear_attn(q, k, v, feature_map=name, feature_weight=w, normalize=True, backend=b)[0]
            for b in ("reference", "triton")
        ]
        close(outs[1], outs[0])


def test_feature_map_arguments():
    q, k, v, _, _, _ = make_attn(1, 3, 2, 1, 16, 8, "")
    with pytest.raises(ValueError, match="unknown feature_map"):
        K.chunk_linear_attn(q, k, v, feature_map="taylor")
    with pytest.raises(ValueError, match="needs feature_weight"):
        K.fused_recurrent_linear_attn(q, k, v, feature_map="hedgehog")
    with pytest.raises(ValueError, match="needs feature_weight"):
        K.chunk_linear_attn(q, k, v, feature_map="performer", feature_weight=torch.randn(2, 16, 8))
    with pytest.raises(ValueError, match="takes no feature_weight"):
        K.chunk_linear_attn(q, k, v, feature_map="elu", feature_weight=torch.randn(1, 16, 8))
    with pytest.raises(ValueError, match="gk must be"):  # gk gates the 2 * 6 hedgehog features
        K.chunk_linear_attn(
            q, k, v, gk=torch.zeros(1, 3, 1, 16), feature_map="hedgehog", feature_weight=torch.randn(1, 16, 6)
        )
    assert K.chunk_linear_attn(q, k, v, feature_map="identity")[0].equal(K.chunk_linear_attn(q, k, v)[0])


# --------------------------------------------------------------------------- key mask (left padding)


def left_padding(B, T):
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, :3] = False  # row 0 left-padded; a padding token in the middle of row 1 too
    if B > 1:
        mask[1, T // 2] = False
    return mask


def check_mask(op, name, gates, normalize, shape, grads=True):
    """mask= against the naive loop on phi(k) zeroed and log gates set to 0 at padding (what the
    cells do), forward and gradients; padding keys' raw k, v and gates are garbage there."""
    from rnnify.cells.base import CellSpec
    from rnnify.cells.linear import build_feature_map

    B, T, H, Hkv, D, V = shape
    q, k, v, g, gk, h0 = make_attn(B, T, H, Hkv, D, V, gates)
    mask = left_padding(B, T)
    pad = ~mask[:, :, None, None]
    k = torch.where(pad, 3.0, k)  # elu(3) + 1 = 4: nothing of it may reach S or z
    g = None if g is None else torch.where(~mask[:, :, None], -5.0, g)
    gk = None if gk is None else torch.where(pad, -5.0, gk)
    weight, scale, Fd = None, 0.3, D
    if name in ("hedgehog", "performer"):
        spec = CellSpec(num_heads=H, num_kv_heads=Hkv, head_dim=D, value_dim=V, scale=scale)
        phi = build_feature_map(
            name, spec, **{"hedgehog": {"feature_dim": 24}, "performer": {"num_features": 20}}[name]
        )
        weight = torch.randn(phi.weight.shape, generator=torch.Generator().manual_seed(1))
        Fd = phi.feature_dim
        if gk is not None:
            gk = torch.where(pad, -5.0, F.logsigmoid(torch.randn(B, T, Hkv, Fd) + 2))
    state = torch.rand(B, Hkv, Fd, V), torch.rand(B, Hkv, Fd)
    state = state if normalize else state[0]
    leaves = [x.requires_grad_() for x in (q, k, v, g, gk, weight) if x is not None]

    def naive():
        phi_q = common.naive_feature_map(q, name, weight, scale, query_shift=normalize)
        phi_k = torch.where(pad, 0.0, common.naive_feature_map(k, name, weight, scale))
        mg = None if g is None else torch.where(mask[:, :, None], g, 0.0)
        mgk = None if gk is None else torch.where(pad, 0.0, gk)
        c = scale if name == "identity" else 1.0
        return K.naive_recurrent_linear_attn(
            phi_q, phi_k, v, mg, mgk, scale=c, initial_state=state, output_final_state=True, normalize=normalize
        )

    def fused():
        return op(
            q,
            k,
            v,
            g,
            gk,
            scale=scale,
            initial_state=state,
            output_final_state=True,
            normalize=normalize,
            feature_map=name,
            feature_weight=weight,
            mask=mask,
        )

    results = []
    for fn in (naive, fused):
        o, h = fn()
        assert torch.isfinite(o).all()
        hs = h if normalize else (h,)
        loss = (o * torch.linspace(-1, 1, V)).sum() + sum((x * x).sum() for x in hs)
        results.append((o, hs, torch.autograd.grad(loss, leaves) if grads else ()))
    (ref, ref_h, ref_g), (out, out_h, out_g) = results
    close(out, ref)
    for a, b in zip(out_h, ref_h):
        close(a, b)
    for a, b in zip(out_g, ref_g):
        close_grad(a, b)
    if grads:  # padding keys, values and gates get no gradient
        dk, dv = out_g[1], out_g[2]
        assert (dk[~mask] == 0).all() and (dv[~mask] == 0).all()
        for d in out_g[3 : 3 + (g is not None) + (gk is not None)]:
            assert (d[~mask] == 0).all()


@pytest.mark.parametrize("op", OPS, ids=lambda f: f.__name__)
@pytest.mark.parametrize(
    "name, gates, normalize",
    [
        ("identity", "g+gk", False),
        ("elu", "g", True),
        ("elu", "gk", False),
        ("hedgehog", "", True),
        ("performer", "gk", True),
        ("relu", "", False),
    ],
)
def test_mask(triton_path, no_reference, op, name, gates, normalize):
    check_mask(op, name, gates, normalize, (2, 11, 4, 2, 16, 8))


@pytest.mark.parametrize("op", OPS, ids=lambda f: f.__name__)
def test_mask_reference_path(op):
    check_mask(op, "elu", "g+gk", True, (2, 11, 4, 2, 16, 8))


@pytest.mark.slow
@pytest.mark.parametrize("gates", GATES)
def test_mask_several_chunks(triton_path, no_reference, gates):
    check_mask(K.chunk_linear_attn, "elu", gates, True, (2, 70, 2, 1, 16, 16))


def test_mask_all_real_is_no_mask(triton_path):
    q, k, v, g, gk, h0 = make_attn(2, 5, 2, 1, 16, 8, "g+gk")
    ones = torch.ones(2, 5, dtype=torch.bool)
    for op in OPS:
        close(op(q, k, v, g, gk, initial_state=h0, mask=ones)[0], op(q, k, v, g, gk, initial_state=h0)[0])
    with pytest.raises(ValueError, match="mask must be"):
        K.chunk_linear_attn(q, k, v, mask=ones[:, :4])


def test_a_state_of_another_shape_is_refused():
    """A state comes from the step's graph, which a model directory holds; the Triton paths index it by
    the shapes of the other inputs, so every op checks it first, whichever path it takes."""
    q, k, v, g, gk, h0 = make_attn(2, 5, 2, 1, 16, 8, "g+gk")  # h0 [2, 1, 16, 8]
    for op in OPS:
        with pytest.raises(ValueError, match=r"initial_state must be \[2, 1, 16, 8\], got \[2, 1, 16, 9\]"):
            op(q, k, v, g, gk, initial_state=torch.zeros(2, 1, 16, 9))
        with pytest.raises(ValueError, match=r"initial_state\[1\] must be \[2, 1, 16\], got \[1, 1, 16\]"):
            op(q, k, v, initial_state=(h0, torch.zeros(1, 1, 16)), normalize=True)
    b = torch.randn(2, 5, 3)
    with pytest.raises(ValueError, match=r"initial_state must be \[2, 3\], got \[3, 3\]"):
        K.linear_recurrence(torch.rand(2, 5, 3), b, torch.zeros(3, 3))
    s, values = torch.randn(2, 5, 2), torch.randn(2, 5, 2, 4)
    state = (torch.zeros(2, 2), torch.ones(2, 2), torch.zeros(2, 2, 8))
    with pytest.raises(ValueError, match=r"initial_state's w must be \[2, 2, 4\], got \[2, 2, 8\]"):
        K.aaren_scan(s, values, state)
    ring = (torch.zeros(2, 1, 4, 16), torch.zeros(2, 1, 4, 8), torch.zeros(2, dtype=torch.long))
    token = (torch.randn(2, 1, 2, 16), torch.randn(2, 1, 1, 16), torch.randn(2, 1, 1, 8))
    K.window_attn_step(*token, *ring)  # the shapes that fit
    for index, bad, message in (
        (1, torch.zeros(2, 1, 3, 8), r"values must be \[2, 1, 4, 8\], got \[2, 1, 3, 8\]"),
        (2, torch.zeros(3, dtype=torch.long), r"length must be \[2\], got \[3\]"),
        (0, torch.zeros(2, 3, 4, 16), r"keys must be \[B, H_kv, W, K\] with H_kv dividing 2"),
    ):
        with pytest.raises(ValueError, match=message):
            K.window_attn_step(*token, *(bad if i == index else x for i, x in enumerate(ring)))


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


# --------------------------------------------------------------------------- backend=


def _call_each_op(backend):
    """Every public op once, small, with ``backend``; returns their outputs."""
    q, k, v, g, _, h0 = make_attn(1, 5, 2, 1, 16, 16, "g")
    ring = k.new_zeros(1, 1, 4, 16)
    return [
        K.fused_recurrent_linear_attn(q, k, v, g, initial_state=h0, backend=backend)[0],
        K.chunk_linear_attn(q, k, v, g, initial_state=h0, backend=backend)[0],
        K.linear_recurrence(k[:, :, 0, :3].sigmoid(), v[:, :, 0, :3], backend=backend)[0],
        K.aaren_scan(q[..., 0], q, backend=backend)[0],
        K.window_attn_step(q[:, :1], k[:, :1], v[:, :1], ring, ring, torch.zeros(1, dtype=torch.long), backend=backend)[
            0
        ],
    ]


def test_resolve_backend(monkeypatch):
    x = torch.zeros(1)
    assert utils.BACKENDS == ("auto", "triton", "reference")
    monkeypatch.setattr(utils, "FORCE_TRITON", False)
    assert [utils.resolve_backend(b, x) for b in utils.BACKENDS] == [False, True, False]
    monkeypatch.setattr(utils, "FORCE_TRITON", True)
    assert [utils.resolve_backend(b, x) for b in utils.BACKENDS] == [True, True, False]
    with pytest.raises(RnnifyError, match="unknown kernels 'cuda'; choose from: auto, triton, reference$"):
        utils.resolve_backend("cuda", x)
    monkeypatch.setattr(utils, "INTERPRET", False)
    with pytest.raises(RnnifyError, match="TRITON_INTERPRET"):
        utils.resolve_backend("triton", x)
    assert not utils.resolve_backend("reference", x)
    monkeypatch.setattr(utils, "HAS_TRITON", False)
    with pytest.raises(RnnifyError, match="cannot be imported"):
        utils.resolve_backend("triton", x)
    assert not utils.resolve_backend("auto", x)


def test_backend_pins_the_path(monkeypatch):
    """ "triton" runs the kernels with FORCE_TRITON off; "reference" runs none with it on; both agree."""
    calls = []
    nan_empty = utils.empty
    monkeypatch.setattr(utils, "empty", lambda *a, **kw: calls.append(1) or nan_empty(*a, **kw))
    monkeypatch.setattr(utils, "FORCE_TRITON", False)
    triton_out = _call_each_op("triton")
    assert len(calls) >= 5
    monkeypatch.setattr(utils, "FORCE_TRITON", True)
    calls.clear()
    ref_out = _call_each_op("reference")
    assert not calls
    for a, b in zip(triton_out, ref_out):
        close(a, b)
    for op in (K.chunk_linear_attn, K.fused_recurrent_linear_attn):
        with pytest.raises(RnnifyError, match="unknown kernels 'gpu'"):
            op(*make_attn(1, 2, 1, 1, 4, 4, "")[:3], backend="gpu")
    with pytest.raises(RnnifyError, match="unknown kernels 'none'"):  # a model's choice, not an op's backend
        q = make_attn(1, 2, 1, 1, 4, 4, "")[0]
        K.aaren_scan(q[..., 0], q, backend="none")


def test_backend_in_autograd(no_reference):
    """The pinned backend reaches the backward: "triton" differentiates with the kernels."""
    q, k, v, g, gk, h0 = make_attn(1, 9, 2, 1, 16, 16, "g+gk")
    leaves = [x.requires_grad_() for x in (q, k, v, g, gk, h0)]
    o, h = K.chunk_linear_attn(q, k, v, g, gk, initial_state=h0, output_final_state=True, backend="triton")
    grads = torch.autograd.grad(o.sum() + h.sum(), leaves)
    ref = K.naive_recurrent_linear_attn(q, k, v, g, gk, initial_state=h0, output_final_state=True)
    for a, b in zip(grads, torch.autograd.grad(ref[0].sum() + ref[1].sum(), leaves)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-4)


# --------------------------------------------------------------------------- export (fake impls)


class _Ops(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("hedgehog", torch.randn(1, 16, 6))

    def forward(self, q, k, v, g, h0, a):
        o1, h1 = K.fused_recurrent_linear_attn(
            q, k, v, g=g, initial_state=h0, output_final_state=True, backend="reference"
        )
        o2, h2 = K.chunk_linear_attn(q, k, v, g=g, initial_state=h0, output_final_state=True, normalize=False)
        x, hx = K.linear_recurrence(a, v[:, :, 0], reverse=True, output_final_state=True)
        o3, (m, u, w) = K.aaren_scan(q[..., 0], q, output_final_state=True)
        ring = k.new_zeros(k.shape[0], k.shape[2], 4, k.shape[3])
        o4, _ = K.window_attn_step(q[:, :1], k[:, :1], v[:, :1], ring, ring, torch.zeros(k.shape[0], dtype=torch.long))
        o5, h5 = K.chunk_linear_attn(
            q, k, v, output_final_state=True, normalize=True, feature_map="hedgehog", feature_weight=self.hedgehog
        )  # the state has 12 features
        return o1 + o2, h1 + h2, x, hx, o3, m, u, w, o4, o5, *h5


def test_export():
    q, k, v, g, _, h0 = make_attn(1, 5, 2, 1, 16, 16, "g")
    args = (q, k, v, g, h0, torch.rand(1, 5, 16))
    model = _Ops()
    ep = torch.export.export(model, args)
    targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    for name in (
        "fused_recurrent_linear_attn",
        "chunk_linear_attn",
        "linear_recurrence",
        "aaren_scan",
        "window_attn_step",
    ):
        assert any(name in t for t in targets), (name, targets)
    for a, b in zip(ep.module()(*args), model(*args)):
        close(a, b)


def opcheck_cases():
    q, k, v, g, _, h0 = make_attn(1, 5, 2, 1, 16, 8, "g")
    w = torch.randn(1, 16, 6)
    s, a = torch.randn(1, 5, 2), torch.rand(1, 5, 3)
    aaren_state = (torch.randn(1, 2), torch.rand(1, 2) + 0.5, torch.randn(1, 2, 8))
    keys, values, valid = torch.randn(1, 1, 7, 16), torch.randn(1, 1, 7, 8), torch.rand(1, 7) > 0.3
    ops = torch.ops.rnnify
    return [
        (ops.chunk_linear_attn, (q, k, v, g, None, h0, 0.25)),
        (ops.fused_recurrent_linear_attn, (q, k, v, g, None, h0, 0.25)),
        (ops.chunk_linear_attn, (q, k, v, g, None, h0[:, :, :12], 0.25, "hedgehog", w, True)),
        (ops.fused_recurrent_linear_attn, (q, k, v, g, None, None, 0.25, "performer", w, True)),
        (ops.chunk_linear_attn, (q, k, v, g, None, h0, 0.25, "elu"), {"mask": left_padding(1, 5)}),
        (ops.fused_recurrent_linear_attn, (q, k, v, g, None, h0, 0.25), {"mask": left_padding(1, 5)}),
        (ops.linear_recurrence, (a, s[..., :1].expand(1, 5, 3).contiguous(), None, False)),
        (ops.aaren_scan, (s, v[:, :, :1].expand(1, 5, 2, 8).contiguous(), *aaren_state)),
        (ops.window_attn_step, (q[:, 0], keys, values, valid, 0.25)),
    ]


@pytest.mark.parametrize("backend", ["triton", pytest.param("reference", marks=pytest.mark.slow)])
def test_opcheck(backend):
    """torch.library.opcheck: schemas, fake impls, autograd registration, and the backward traced
    by AOT autograd (the Triton backward runs through its own custom ops for that)."""
    for op, args, *kwargs in opcheck_cases():
        args = [x.clone().requires_grad_(x.is_floating_point()) if isinstance(x, torch.Tensor) else x for x in args]
        torch.library.opcheck(op, args, {"backend": backend, **(kwargs[0] if kwargs else {})})


# --------------------------------------------------------------------------- larger


@pytest.mark.slow
def test_kernels_compile_for_sm90():
    """What the interpreter cannot check: every kernel compiles to sm_90 and fits its shared memory."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, "-m", "rnnify.kernels.compile_check"], env=env, capture_output=True, text=True, timeout=900
    )
    assert run.returncode == 0, run.stdout + run.stderr


@pytest.mark.slow
@pytest.mark.parametrize("op", OPS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("gates", GATES)
def test_linear_attn_long(triton_path, op, gates):
    check_attn(op, (2, 150, 8, 2, 64, 64), gates)


@pytest.mark.slow
@pytest.mark.parametrize("op", OPS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("gates", ["", "g+gk"])
def test_linear_attn_gradients_long(triton_path, no_reference, op, gates):
    check_gradients(op, (2, 150, 8, 2, 64, 96), gates, normalize=False)  # V = 96: two value blocks


# the cells' default sizes at d = 64: hedgehog F = 128, performer F = int(64 ln 64) = 266 (BT = 16, BV = 16)
@pytest.mark.slow
@pytest.mark.parametrize("op", OPS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("name", ["hedgehog", "performer"])
def test_feature_maps_long(triton_path, no_reference, op, name):
    check_feature_map(op, name, True, (2, 70, 4, 1, 64, 32), {})
