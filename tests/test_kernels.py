"""rnnify.kernels' linear-attention kernels (feature maps, masks) against their naive references,
under TRITON_INTERPRET=1 on CPU (the scans: test_kernels_scans.py; the ops as a whole: test_kernels_ops.py).

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

from kernel_support import close, close_grad, left_padding, make_attn, nan_buffers, no_reference, triton_path  # noqa: F401 - fixtures, nan_buffers autouse

import rnnify.kernels as K
from rnnify.cells.aaren import naive_recurrent_aaren
from rnnify.cells.linear import naive_recurrent_feature_attn
from rnnify.kernels.linear_attn import common
from rnnify.kernels.linear_attn.naive import naive_recurrent_gated_attn

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


# --------------------------------------------------------------------------- larger


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
