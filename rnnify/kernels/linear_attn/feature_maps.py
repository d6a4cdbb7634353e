"""Feature maps phi the linear-attention kernels apply to q and k themselves (``feature_map=``).

The math is rnnify.cells.linear's (EluFeatureMap, ReluFeatureMap, HedgehogFeatureMap,
PerformerFeatureMap), so a cell can hand its raw q, k and weight to the fused op. ``scale`` is the
attention's score scale s; how it enters depends on the map:

    identity   phi(x) = x                                              o = s phi(q) S   (fla's convention)
    elu        phi(x) = elu(x) + 1                                     o = phi(q) S     (the cell's maps
    relu       phi(x) = relu(x)                                        o = phi(q) S      take no scale)
    hedgehog   phi(x) = [softmax(x W), softmax(-x W)],  W [H_kv, K, F/2]           o = phi(q) S
    performer  phi(x) = exp(x' W - |x'|^2 / 2) / sqrt(m),  x' = x sqrt(s),  W [H_kv, K, m]
               and, when the output is normalised, each query's max exponent is subtracted
               (a factor the normaliser cancels; detached, as in the cell)          o = phi(q) S

Query head i uses the weight of its kv head, W[i // (H / H_kv)]. The state then has F features:
K for identity / elu / relu, 2 (F/2) for hedgehog, m for performer.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from rnnify.kernels.utils import tl, triton

FEATURE_MAPS = ("identity", "elu", "relu", "hedgehog", "performer")
PROJECTED = ("hedgehog", "performer")


def check_feature_map(feature_map: str | None, weight: torch.Tensor | None, k: torch.Tensor) -> str:
    """Validate the map and its weight against k ``[B, T, H_kv, K]``; returns the map's name."""
    feature_map = "identity" if feature_map is None else feature_map
    if feature_map not in FEATURE_MAPS:
        raise ValueError(f"unknown feature_map {feature_map!r}; choose from {FEATURE_MAPS} (or None)")
    if feature_map not in PROJECTED:
        if weight is not None:
            raise ValueError(f"feature_map {feature_map!r} takes no feature_weight")
        return feature_map
    Hkv, K = k.shape[2], k.shape[3]
    if weight is None or weight.dim() != 3 or tuple(weight.shape[:2]) != (Hkv, K):
        got = None if weight is None else tuple(weight.shape)
        raise ValueError(f"feature_map {feature_map!r} needs feature_weight [H_kv, K, n] = [{Hkv}, {K}, n], got {got}")
    return feature_map


def feature_dim(feature_map: str, K: int, weight: torch.Tensor | None) -> int:
    if feature_map == "hedgehog":
        return 2 * weight.shape[-1]
    if feature_map == "performer":
        return weight.shape[-1]
    return K


def output_scale(feature_map: str, scale: float) -> float:
    """The factor on phi(q) in o = factor phi(q) S: only the identity map applies the score scale there."""
    return scale if feature_map == "identity" else 1.0


def naive_feature_map(
    x: torch.Tensor, feature_map: str, weight: torch.Tensor | None, scale: float, query_shift: bool = False
) -> torch.Tensor:
    """phi(x) for x ``[B, T, H, K]`` in fp32 (H query or kv heads; the weight is per kv head).
    ``query_shift``: performer's per-query shift, for normalised queries."""
    x = x.float()
    if feature_map == "identity":
        return x
    if feature_map == "elu":
        return F.elu(x) + 1
    if feature_map == "relu":
        return F.relu(x)
    w = weight.float().repeat_interleave(x.shape[2] // weight.shape[0], dim=0)  # [H, K, n]
    if feature_map == "hedgehog":
        u = torch.einsum("bthk,hkf->bthf", x, w)
        return torch.cat([torch.softmax(u, dim=-1), torch.softmax(-u, dim=-1)], dim=-1)
    x = x * scale**0.5
    u = torch.einsum("bthk,hkf->bthf", x, w) - (x * x).sum(-1, keepdim=True) / 2
    if query_shift:
        u = u - u.amax(-1, keepdim=True).detach()
    return torch.exp(u - 0.5 * math.log(weight.shape[-1]))


if triton is not None:

    @triton.jit
    def load_feature_weight(w, i_h, o_k, o_f, K: tl.constexpr, F: tl.constexpr, FEATURE: tl.constexpr):
        """kv head i_h's weight as a [BK, BF] tile, None for the maps without one; hedgehog's is
        [W, -W], so x W gives [u, -u]."""
        mask = (o_k < K)[:, None] & (o_f < F)[None, :]
        b_w = None
        if FEATURE == "hedgehog":
            HALF: tl.constexpr = F // 2
            col = tl.where(o_f < HALF, o_f, o_f - HALF)
            b_w = tl.load(w + (i_h * K + o_k[:, None]) * HALF + col[None, :], mask=mask, other=0.0).to(tl.float32)
            b_w = tl.where((o_f < HALF)[None, :], b_w, -b_w)
        elif FEATURE == "performer":
            b_w = tl.load(w + (i_h * K + o_k[:, None]) * F + o_f[None, :], mask=mask, other=0.0).to(tl.float32)
        return b_w

    @triton.jit
    def _featurize(x, xw, o_f, fshift, F: tl.constexpr, FEATURE: tl.constexpr, QUERY_SHIFT: tl.constexpr):
        # phi over the last axis: of x itself (identity / elu / relu: x's axis is the feature axis), or
        # of the projection xw = x W (hedgehog; performer, whose x is already x'); features >= F are 0
        m_f = o_f < F
        if FEATURE == "elu":
            phi = tl.where(x > 0, x + 1.0, tl.exp(x))
        elif FEATURE == "relu":
            phi = tl.maximum(x, 0.0)
        elif FEATURE == "hedgehog":  # a softmax over each half
            first = o_f < F // 2
            m1 = tl.max(tl.where(first & m_f, xw, float("-inf")), axis=-1, keep_dims=True)
            m2 = tl.max(tl.where(first | ~m_f, float("-inf"), xw), axis=-1, keep_dims=True)
            e = tl.where(m_f, tl.exp(xw - tl.where(first, m1, m2)), 0.0)
            s1 = tl.sum(tl.where(first, e, 0.0), axis=-1, keep_dims=True)
            s2 = tl.sum(tl.where(first, 0.0, e), axis=-1, keep_dims=True)
            phi = e / tl.where(first, s1, s2)
        elif FEATURE == "performer":
            u = xw - tl.sum(x * x, axis=-1, keep_dims=True) / 2
            if QUERY_SHIFT:
                u = u - tl.max(tl.where(m_f, u, float("-inf")), axis=-1, keep_dims=True)
            phi = tl.exp(u - fshift)
        else:
            phi = x
        return tl.where(m_f, phi, 0.0)

    @triton.jit
    def feature_map_2d(
        x,
        b_w,
        o_f,
        fsqrt,
        fshift,
        F: tl.constexpr,
        FEATURE: tl.constexpr,
        QUERY_SHIFT: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        """phi of a tile x [BT, BK] -> [BT, BF] (b_w from load_feature_weight for projected maps;
        fsqrt = sqrt(scale), fshift = log(m) / 2 for performer)."""
        xw = x
        if FEATURE == "performer":
            x = x * fsqrt
            xw = tl.dot(x, b_w, input_precision=PRECISION)
        elif FEATURE == "hedgehog":
            xw = tl.dot(x, b_w, input_precision=PRECISION)
        return _featurize(x, xw, o_f, fshift, F, FEATURE, QUERY_SHIFT)

    @triton.jit
    def feature_map_1d(x, b_w, o_f, fsqrt, fshift, F: tl.constexpr, FEATURE: tl.constexpr, QUERY_SHIFT: tl.constexpr):
        """phi of one token's x [BK] -> [BF], as ``feature_map_2d``."""
        xw = x
        if FEATURE == "performer":
            x = x * fsqrt
            xw = tl.sum(x[:, None] * b_w, axis=0)
        elif FEATURE == "hedgehog":
            xw = tl.sum(x[:, None] * b_w, axis=0)
        return _featurize(x, xw, o_f, fshift, F, FEATURE, QUERY_SHIFT)


def kernel_args(feature_map: str, scale: float, weight: torch.Tensor | None, query_shift: bool) -> dict:
    """The feature-map arguments of the forward kernels (``scale`` is the score scale)."""
    fshift = 0.5 * math.log(weight.shape[-1]) if feature_map == "performer" else 0.0
    return dict(
        scale=output_scale(feature_map, scale),
        fsqrt=scale**0.5,
        fshift=fshift,
        FEATURE=feature_map,
        QUERY_SHIFT=bool(query_shift) and feature_map == "performer",
    )
