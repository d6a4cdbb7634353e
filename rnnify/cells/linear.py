"""Linear attention ("Transformers are RNNs", Katharopoulos et al. 2020, docs/math.md §Linear attention).

Softmax's exp(q . k) is replaced by phi(q) . phi(k), so the past folds into a constant state:

    S_t = S_{t-1} + phi(k_t)^T v_t          [d_phi, d_v]  per kv head
    z_t = z_{t-1} + phi(k_t)                [d_phi]
    o_t = phi(q_t) S_t / (phi(q_t) . z_t + eps)          (normalize=True, the default)
    o_t = phi(q_t) S_t                                   (normalize=False: no z state at all)

Forms on featurised inputs (``*_feature_attn``, named apart from the ``rnnify.kernels`` ops, which
take raw q, k in another layout), all computing the same thing (tests hold them to
``naive_recurrent_feature_attn``):
``naive_recurrent_*`` (a plain loop, the ground truth), ``parallel_*`` (masked quadratic),
``chunk_*`` (O(T * C): quadratic inside chunks of C tokens, the recurrence between chunks; the
prefill path), ``step_*`` (one token; the decode path) and ``fused_*`` (the same through the
``rnnify.kernels`` ops, once ``use_kernels`` is set: ``chunk_linear_attn`` for T > 1,
``fused_recurrent_linear_attn`` for T == 1, from the raw q, k: the ops apply the map (elu, relu,
identity, hedgehog, performer; ``FeatureMap.kernel_form``) and the padding mask themselves, other
maps are applied first; their (S, z) state is this cell's (kv, k_sum)). Shapes: phi_q ``[B, Hkv, G, T, F]``
(G query heads per kv head), phi_k ``[B, Hkv, T, F]``, v ``[B, Hkv, T, Dv]``, state
``kv [B, Hkv, F, Dv]`` and ``k_sum [B, Hkv, F]`` in fp32. ``k_sum=None`` is the unnormalised
form: every form then returns ``(out, kv, None)``.

Feature maps phi (``FEATURE_MAPS``), applied to the q and k the original attention saw (after
RoPE); s = scale * q . k is the score softmax attention would exponentiate:

    elu        elu(x) + 1                                          Katharopoulos et al. 2020
    relu       relu(x)
    identity   x                           (unnormalised, it is what ``gated-rnn`` computes)
    performer  exp(W x' - |x'|^2 / 2) / sqrt(m),  x' = x sqrt(scale),  W ~ N(0, I) fixed
               E_W[phi(q) . phi(k)] = exp(s)  (FAVOR+, Choromanski et al. 2021)
    taylor     [1, x', vec(x' x'^T) / sqrt(2)]:  phi(q) . phi(k) = 1 + s + s^2 / 2   (Based)
    hedgehog   [softmax(x W), softmax(-x W)],  W trainable per kv head (Zhang et al. 2024)
    t2r        relu(x W + b),  W, b trainable per kv head  (Kasai et al. 2021)
"""

from __future__ import annotations

import inspect
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from rnnify import kernels
from rnnify.cells.base import Cell, CellSpec, every_token_real
from rnnify.errors import check_int

# the ungated forms live beside the gated ones, where the ops' reference runs them too
from rnnify.kernels.linear_attn.naive import (  # noqa: F401 (the cell's reference forms, under its name)
    Forms,
    chunk_feature_attn,
    naive_recurrent_feature_attn,
    normalise,
    parallel_feature_attn,
)

# --------------------------------------------------------------------------- feature maps


class FeatureMap(nn.Module):
    """phi: ``[B, H_kv, ..., d] -> [B, H_kv, ..., feature_dim]``.

    Dimension 1 is the kv head, so maps with per-head weights apply the weights of kv head h to
    its keys and to the queries of its group alike. ``options()`` returns the keyword arguments
    that rebuild the map (JSON-able, defaults resolved). ``non_negative_products``: phi(q) . phi(k) >= 0
    for every q and k, so a sum that adds such products to a positive term needs no guard against 0.
    """

    non_negative_products = False

    def __init__(self, spec: CellSpec):
        super().__init__()
        self.spec = spec

    @property
    def feature_dim(self) -> int:
        return self.spec.head_dim

    def options(self) -> dict[str, Any]:
        return {}

    def kernel_form(self) -> tuple[str, torch.Tensor | None, float] | None:
        """How the ``rnnify.kernels`` linear-attention ops apply this very map themselves:
        ``(feature_map, feature_weight, scale)`` for their arguments (``kernels.linear_attn.feature_maps``
        has the same math), or None when they do not have it (the map is then applied in PyTorch)."""
        return None

    def normalised_query(self, x: torch.Tensor) -> torch.Tensor:
        """Features for queries whose output is normalised (o = phi(q) S / (phi(q) . z + eps)).

        May differ from ``phi(x)`` by a positive factor per query, which the normaliser cancels
        (up to eps); maps use it to keep exponents in range. Default: ``phi(x)``.
        """
        return self(x)


def _per_head(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x [B, H, ..., d] @ weight [H, d, f] -> [B, H, ..., f]``: kv head h uses weight[h]."""
    shape = x.shape
    y = x.reshape(shape[0], shape[1], -1, shape[-1]) @ weight.to(x.dtype)
    return y.reshape(*shape[:-1], weight.shape[-1])


def _check_feature_dim(name: str, value: Any, even: bool = False) -> int:
    if check_int(name, value) % 2 and even:
        raise ValueError(f"{name} must be a positive{' even' if even else ''} integer, got {value!r}")
    return value


class EluFeatureMap(FeatureMap):
    """elu(x) + 1: positive, so the normaliser never vanishes (Katharopoulos et al.)."""

    non_negative_products = True

    def kernel_form(self):
        return "elu", None, 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.elu(x) + 1


class ReluFeatureMap(FeatureMap):
    """relu(x): non-negative; a query or key with no positive entry contributes nothing."""

    non_negative_products = True

    def kernel_form(self):
        return "relu", None, 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x)


class IdentityFeatureMap(FeatureMap):
    """x itself: with ``normalize=False`` this is plain (unnormalised) linear attention q S."""

    def kernel_form(self):
        return "identity", None, 1.0  # the ops' identity multiplies the output by scale: 1 here

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class PerformerFeatureMap(FeatureMap):
    """FAVOR+ positive random features (Choromanski et al. 2021): phi(q) . phi(k) estimates exp(s).

        phi(x) = exp(W x' - |x'|^2 / 2) / sqrt(m),   x' = x * sqrt(scale)

    For w ~ N(0, I), E[exp(w . (x' + y') - |x'|^2/2 - |y'|^2/2)] = exp(x' . y') = exp(scale q . k),
    so the mean over m features is an unbiased estimate whose variance falls as 1/m. ``W``
    ``[H_kv, d, m]`` (independent per kv head) is drawn once from ``seed`` and kept as a persistent
    buffer, so a saved model reloads the very same features; it is not trained.

    Default m = int(d ln d), the rate in FAVOR+'s uniform-convergence bound (m = Theta(d log d))
    and performer-pytorch's default: 266 for d = 64, 16 for d = 8.

    Stabilising (Performer subtracts a max before exp): for normalised queries
    (``normalised_query``) the exponent's max over the m features is subtracted per query, which
    the normaliser cancels; each query then has a feature equal to 1/sqrt(m), so the features
    neither overflow nor all underflow. Keys are not shifted: Performer's key shift is a max over
    the whole sequence, which a causal recurrence cannot know, and a constant shift would only
    rescale every phi(q) . phi(k) (against eps) without preventing anything. Their exponent is
    bounded anyway, W x' - |x'|^2/2 <= |w_i|^2 / 2. Both are per token, so every form agrees.
    """

    non_negative_products = True

    def __init__(self, spec: CellSpec, num_features: int | None = None, seed: int = 0):
        super().__init__(spec)
        d = spec.head_dim
        num_features = max(1, int(d * math.log(d))) if num_features is None else num_features
        self.num_features = _check_feature_dim("num_features", num_features)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an integer, got {seed!r}")
        self.seed = seed
        gen = torch.Generator().manual_seed(seed)
        self.register_buffer("weight", torch.randn(spec.num_kv_heads, d, self.num_features, generator=gen))

    @property
    def feature_dim(self) -> int:
        return self.num_features

    def options(self) -> dict[str, Any]:
        return {"num_features": self.num_features, "seed": self.seed}

    def kernel_form(self):
        return "performer", self.weight, self.spec.scale  # the ops stabilise normalised queries alike

    def _exponent(self, x: torch.Tensor) -> torch.Tensor:
        x = x * self.spec.scale**0.5
        return _per_head(x, self.weight) - (x * x).sum(-1, keepdim=True) / 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.exp(self._exponent(x) - 0.5 * math.log(self.num_features))

    def normalised_query(self, x: torch.Tensor) -> torch.Tensor:
        u = self._exponent(x)
        return torch.exp(u - u.amax(-1, keepdim=True).detach() - 0.5 * math.log(self.num_features))


class TaylorFeatureMap(FeatureMap):
    """Second-order Taylor features (Based): phi(q) . phi(k) = 1 + s + s^2/2 exactly.

        phi(x) = [1, x', vec(x' x'^T) / sqrt(2)],   x' = x * sqrt(scale)

    since vec(x x^T) . vec(y y^T) = (x . y)^2. 1 + s + s^2/2 > 0 for every s, so the normaliser
    stays positive. feature_dim = 1 + d + d^2 (4,161 for d = 64: a large state).
    """

    non_negative_products = True

    @property
    def feature_dim(self) -> int:
        d = self.spec.head_dim
        return 1 + d + d * d

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * self.spec.scale**0.5
        second = (x[..., :, None] * x[..., None, :]).flatten(-2) / math.sqrt(2)
        return torch.cat([torch.ones_like(x[..., :1]), x, second], dim=-1)


class HedgehogFeatureMap(FeatureMap):
    """Hedgehog (Zhang et al. 2024): phi(x) = [softmax(x W), softmax(-x W)], softmax over features.

    ``W`` ``[H_kv, d, feature_dim / 2]`` is an ``nn.Parameter`` (trained by attention transfer,
    docs/math.md §Attention transfer), initialised to the identity (padded with zeros or cut when feature_dim != 2d).
    Features are positive and each half sums to 1, so the normaliser never vanishes.
    """

    non_negative_products = True

    def __init__(self, spec: CellSpec, feature_dim: int | None = None):
        super().__init__(spec)
        d = spec.head_dim
        self._feature_dim = _check_feature_dim("feature_dim", 2 * d if feature_dim is None else feature_dim, even=True)
        eye = torch.eye(d, self._feature_dim // 2)
        self.weight = nn.Parameter(eye.expand(spec.num_kv_heads, -1, -1).clone())

    @property
    def feature_dim(self) -> int:
        return self._feature_dim

    def options(self) -> dict[str, Any]:
        return {"feature_dim": self._feature_dim}

    def kernel_form(self):
        return "hedgehog", self.weight, 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u = _per_head(x, self.weight)
        return torch.cat([torch.softmax(u, dim=-1), torch.softmax(-u, dim=-1)], dim=-1)


class T2RFeatureMap(FeatureMap):
    """T2R (Kasai et al. 2021): phi(x) = relu(x W + b), trained with the model.

    ``W`` ``[H_kv, d, feature_dim]`` and ``b`` ``[H_kv, feature_dim]`` are ``nn.Parameter``s,
    initialised to W = I (padded or cut when feature_dim != d), b = 0: at init phi = relu.
    """

    non_negative_products = True

    def __init__(self, spec: CellSpec, feature_dim: int | None = None):
        super().__init__(spec)
        d = spec.head_dim
        self._feature_dim = _check_feature_dim("feature_dim", d if feature_dim is None else feature_dim)
        self.weight = nn.Parameter(torch.eye(d, self._feature_dim).expand(spec.num_kv_heads, -1, -1).clone())
        self.bias = nn.Parameter(torch.zeros(spec.num_kv_heads, self._feature_dim))

    @property
    def feature_dim(self) -> int:
        return self._feature_dim

    def options(self) -> dict[str, Any]:
        return {"feature_dim": self._feature_dim}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u = _per_head(x, self.weight)
        bias = self.bias.to(x.dtype).reshape(self.bias.shape[0], *[1] * (x.dim() - 3), self.bias.shape[1])
        return F.relu(u + bias)


FEATURE_MAPS: dict[str, type[FeatureMap]] = {
    "elu": EluFeatureMap,
    "relu": ReluFeatureMap,
    "identity": IdentityFeatureMap,
    "performer": PerformerFeatureMap,
    "taylor": TaylorFeatureMap,
    "hedgehog": HedgehogFeatureMap,
    "t2r": T2RFeatureMap,
}


def build_feature_map(name: str, spec: CellSpec, **options: Any) -> FeatureMap:
    """The feature map ``name`` for an attention site of shape ``spec``."""
    if name not in FEATURE_MAPS:
        raise ValueError(f"unknown feature map {name!r}; choose from {sorted(FEATURE_MAPS)}")
    cls = FEATURE_MAPS[name]
    accepted = [p for p in inspect.signature(cls.__init__).parameters if p not in ("self", "spec")]
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        takes = f"it takes {', '.join(accepted)}" if accepted else "it takes no options"
        raise ValueError(f"feature map {name!r} has no option(s) {', '.join(unknown)}; {takes}")
    return cls(spec, **options)


# --------------------------------------------------------------------------- forms


def step_feature_attn(phi_q, phi_k, v, kv, k_sum, eps: float = 1e-6) -> Forms:
    # T == 1: add the outer product phi(k)^T v in one pass over the state, with no temporary of its size;
    # a kv head's G queries read its state as one [G, F] x [F, d_v] product, not from a copy per query head
    kv = torch.addcmul(kv, phi_k[:, :, 0, :, None], v[:, :, 0, None, :])
    if k_sum is not None:
        k_sum = k_sum + phi_k[:, :, 0]
    num, den = read_step(phi_q, kv, k_sum)
    return (num if den is None else normalise(num, den, eps)), kv, k_sum


def read_step(phi_q, kv, k_sum):
    """One token's ``phi_q [B, Hkv, G, 1, F]`` reading ``kv [B, Hkv, F, d_v]`` (and ``k_sum``): ``bmm`` on
    ``[B Hkv, G, F]`` views, so the G query heads of a kv head share its state rather than a copy each
    (what broadcasting ``phi_q @ kv[:, :, None]`` makes). Returns ``(num [B, Hkv, G, 1, d_v], den
    [B, Hkv, G, 1] or None)``."""
    batch, num_kv_heads, group, _, features = phi_q.shape
    queries = phi_q.reshape(batch * num_kv_heads, group, features)
    num = torch.bmm(queries, kv.reshape(batch * num_kv_heads, features, -1)).view(batch, num_kv_heads, group, 1, -1)
    if k_sum is None:
        return num, None
    return num, torch.bmm(queries, k_sum.reshape(batch * num_kv_heads, features, 1)).view(batch, num_kv_heads, group, 1)


def fused_feature_attn(
    q, k, v, kv, k_sum, phi: FeatureMap, mask, eps: float = 1e-6, log_a=None, backend: str = "auto"
) -> Forms:
    """The forms above (and ``cells.gated``'s with ``log_a``) through ``rnnify.kernels``, from the
    raw (not featurised) q ``[B, Hkv, G, T, d]`` and k ``[B, Hkv, T, d]``.

    The ops apply phi themselves when they have it (``phi.kernel_form()``: elu, relu, identity,
    hedgehog, performer, with performer's query stabiliser when normalised, as ``normalised_query``);
    other maps are applied here and the ops run the identity map. ``mask [B, T]`` (False: padding)
    goes to the ops, which give padding keys phi(k) = 0 and log a = 0, as ``FeatureMapCell.features``
    and ``GatedCell.log_gates`` do. Only the layout changes: ``[B, Hkv, G, T, .]`` queries are the
    ops' ``[B, T, H, .]`` (query head h = kv head * G + g, the ops' GQA grouping); ``log_a``
    ``[B, Hkv, T, 1]`` is their scalar gate g, ``[B, Hkv, T, F]`` their per-channel gate gk.
    """
    batch, num_kv_heads, group, length, _ = q.shape
    form = phi.kernel_form()
    if form is None:
        q, k = (phi.normalised_query(q.float()) if k_sum is not None else phi(q.float())), phi(k.float())
        form = ("identity", None, 1.0)
    feature_map, weight, scale = form
    q = q.reshape(batch, num_kv_heads * group, length, -1).transpose(1, 2)
    g = gk = None
    if log_a is not None:
        g, gk = (log_a[..., 0].transpose(1, 2), None) if log_a.shape[-1] == 1 else (None, log_a.transpose(1, 2))
    op = kernels.fused_recurrent_linear_attn if length == 1 else kernels.chunk_linear_attn
    state = kv if k_sum is None else (kv, k_sum)
    out, state = op(
        q,
        k.transpose(1, 2),
        v.transpose(1, 2),
        g,
        gk,
        scale=scale,
        initial_state=state,
        output_final_state=True,
        normalize=k_sum is not None,
        eps=eps,
        feature_map=feature_map,
        feature_weight=weight,
        mask=mask,
        backend=backend,
    )
    kv, k_sum = (state, None) if k_sum is None else state
    return out.transpose(1, 2).reshape(batch, num_kv_heads, group, length, -1), kv, k_sum


# --------------------------------------------------------------------------- the cell

# The linear-attention kernels hold all F features of a state block per program (no tiling over
# F); ``kernels.linear_attn.chunk.block_sizes`` shrinks BT and BV as F grows. Compiled for sm_90
# (``python -m rnnify.kernels.compile_check --features 256``, limit 227 KB of shared memory), F = 256
# (hedgehog at d = 128) fits with every gate: chunk forward 172 KB (no gate / scalar gate, BT = 32)
# and 168 KB (per-channel gate, BT = 16), chunk backward 78 KB (37 KB with a per-channel gate),
# fused_recurrent 1 KB. Shared memory only: register spills and speed are unmeasured (no GPU run).
# F > 256 (performer's default m at d = 64: 266, i.e. BF = 512; taylor from d = 11) keeps the
# PyTorch forms.
KERNEL_MAX_FEATURES = 256


def masked(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """x ``[B, H_kv, T, .]`` with 0 at padding (``mask [B, T]`` False), so padding writes nothing;
    x itself where ``every_token_real``, without the op."""
    return x if every_token_real(mask) else torch.where(mask[:, None, :, None].to(torch.bool), x, 0.0)


class FeatureMapCell(Cell):
    """What every cell with a state (S, z) over phi(k) shares: linear attention and its gated forms.

    Checks and keeps the options they share; ``phi`` is the feature map, ``normalize`` whether a
    normaliser z (state ``k_sum``) divides the output.
    """

    def __init__(
        self,
        spec: CellSpec,
        feature_map: str,
        feature_options: dict[str, Any] | None,
        normalize: bool,
        chunk_size: int,
        eps: float,
    ):
        super().__init__(spec)
        check_int("chunk_size", chunk_size)
        if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps >= 0:
            raise ValueError(f"eps must be a number >= 0, got {eps!r}")
        if feature_options is not None and not isinstance(feature_options, dict):
            raise ValueError(f"feature_options must be a dict of feature map options, got {feature_options!r}")
        if not isinstance(normalize, bool):
            raise ValueError(f"normalize must be true or false, got {normalize!r}")
        if feature_map == "identity" and normalize:
            raise ValueError("feature_map 'identity' needs normalize=False: phi(q) . z can be zero or negative")
        self.phi = build_feature_map(feature_map, spec, **(feature_options or {}))
        self.feature_map, self.chunk_size, self.eps, self.normalize = feature_map, chunk_size, float(eps), normalize
        self.state_names = ("kv", "k_sum") if normalize else ("kv",)

    def init_state(self, batch_size, device, dtype):
        spec, f = self.spec, self.phi.feature_dim
        kv = torch.zeros(batch_size, spec.num_kv_heads, f, spec.value_dim, device=device, dtype=torch.float32)
        if not self.normalize:
            return (kv,)
        return kv, torch.zeros(batch_size, spec.num_kv_heads, f, device=device, dtype=torch.float32)

    def fused_ops(self) -> dict[str, str]:
        if self.phi.feature_dim > KERNEL_MAX_FEATURES:
            return {}
        return {"prefill": "chunk_linear_attn", "decode": "fused_recurrent_linear_attn"}

    def grouped(self, q: torch.Tensor) -> torch.Tensor:
        """q ``[B, H, T, d]`` grouped per kv head: ``[B, H_kv, G, T, d]``."""
        return q.reshape(q.shape[0], self.spec.num_kv_heads, self.spec.group_size, q.shape[2], -1)

    def features(self, q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """phi(q) grouped per kv head ``[B, H_kv, G, T, F]`` (the map's ``normalised_query`` when the
        normaliser cancels a positive factor per query), and phi(k) with padding keys zeroed, in fp32."""
        grouped = self.grouped(q.float())
        phi_q = self.phi.normalised_query(grouped) if self.normalize else self.phi(grouped)
        return phi_q, masked(self.phi(k.float()), mask)


class LinearCell(FeatureMapCell):
    """Linear attention with a feature map (fixed or trainable), normalised or not.

    State: ``(kv [B, H_kv, F, Dv], k_sum [B, H_kv, F])`` with the normaliser, ``(kv,)`` without
    (``normalize=False``); F = ``phi.feature_dim``, fp32.
    """

    target = "linear"
    own_forms_without_triton = frozenset({"prefill", "decode"})
    state_names = ("kv", "k_sum")

    def __init__(
        self,
        spec: CellSpec,
        feature_map: str = "elu",
        chunk_size: int = 64,
        eps: float = 1e-6,
        feature_options: dict[str, Any] | None = None,
        normalize: bool = True,
    ):
        super().__init__(spec, feature_map, feature_options, normalize, chunk_size, eps)

    def options(self) -> dict[str, Any]:
        return {
            "feature_map": self.feature_map,
            "chunk_size": self.chunk_size,
            "eps": self.eps,
            "feature_options": self.phi.options(),
            "normalize": self.normalize,
        }

    def forward(self, q, k, v, mask, *state):
        kv, k_sum = state if self.normalize else (state[0], None)
        mask = mask.to(torch.bool)
        v = masked(v.float(), mask)
        backend = self.backend(q, q.shape[2])
        if backend is not None:  # the ops featurise (and mask) q, k themselves
            out, kv, k_sum = fused_feature_attn(
                self.grouped(q), k, v, kv, k_sum, self.phi, mask, self.eps, backend=backend
            )
        elif q.shape[2] == 1:
            out, kv, k_sum = step_feature_attn(*self.features(q, k, mask), v, kv, k_sum, self.eps)
        else:
            out, kv, k_sum = chunk_feature_attn(*self.features(q, k, mask), v, kv, k_sum, self.eps, self.chunk_size)
        out = out.reshape(q.shape[0], self.spec.num_heads, q.shape[2], -1).to(q.dtype)
        return (out, kv, k_sum) if self.normalize else (out, kv)
