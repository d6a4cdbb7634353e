"""Linear attention ("Transformers are RNNs", Katharopoulos et al. 2020, math.md §2).

Softmax's exp(q . k) is replaced by phi(q) . phi(k), so the past folds into a constant state:

    S_t = S_{t-1} + phi(k_t)^T v_t          [d_phi, d_v]  per kv head
    z_t = z_{t-1} + phi(k_t)                [d_phi]
    o_t = phi(q_t) S_t / (phi(q_t) . z_t + eps)

Forms, all computing the same thing (tests hold them to ``naive_recurrent_linear_attn``):
``naive_recurrent_*`` (a plain loop, the ground truth), ``parallel_*`` (masked quadratic),
``chunk_*`` (O(T * C): quadratic inside chunks of C tokens, the recurrence between chunks; the
prefill path) and ``step_*`` (one token; the decode path). Shapes: phi_q ``[B, Hkv, G, T, F]``
(G query heads per kv head), phi_k ``[B, Hkv, T, F]``, v ``[B, Hkv, T, Dv]``, state
``kv [B, Hkv, F, Dv]`` and ``k_sum [B, Hkv, F]`` in fp32.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from rnnify.cells.base import Cell, CellSpec

Forms = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class FeatureMap(nn.Module):
    """phi: ``[B, H_kv, ..., d] -> [B, H_kv, ..., feature_dim]``.

    Dimension 1 is the kv head, so maps with per-head weights apply the weights of kv head h to
    its keys and to the queries of its group alike.
    """

    def __init__(self, spec: CellSpec):
        super().__init__()
        self.spec = spec

    @property
    def feature_dim(self) -> int:
        return self.spec.head_dim


class EluFeatureMap(FeatureMap):
    """elu(x) + 1: positive, so the normaliser never vanishes (Katharopoulos et al.)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.elu(x) + 1


FEATURE_MAPS: dict[str, type[FeatureMap]] = {"elu": EluFeatureMap}


def build_feature_map(name: str, spec: CellSpec, **options: Any) -> FeatureMap:
    """The feature map ``name`` for an attention site of shape ``spec``."""
    if name not in FEATURE_MAPS:
        raise ValueError(f"unknown feature map {name!r}; choose from {sorted(FEATURE_MAPS)}")
    return FEATURE_MAPS[name](spec, **options)


def _normalise(num: torch.Tensor, den: torch.Tensor, eps: float) -> torch.Tensor:
    return num / (den[..., None] + eps)


def naive_recurrent_linear_attn(phi_q, phi_k, v, kv, k_sum, eps: float = 1e-6) -> Forms:
    outs = []
    for t in range(phi_k.shape[2]):
        kv = kv + phi_k[:, :, t, :, None] * v[:, :, t, None, :]
        k_sum = k_sum + phi_k[:, :, t]
        q_t = phi_q[:, :, :, t]  # [B, Hkv, G, F]
        outs.append(_normalise(q_t @ kv, (q_t * k_sum[:, :, None]).sum(-1), eps))
    return torch.stack(outs, dim=3), kv, k_sum


def parallel_linear_attn(phi_q, phi_k, v, kv, k_sum, eps: float = 1e-6) -> Forms:
    length = phi_k.shape[2]
    causal = torch.ones(length, length, dtype=torch.bool, device=v.device).tril()
    scores = torch.einsum("bhgtf,bhsf->bhgts", phi_q, phi_k).masked_fill(~causal, 0.0)
    num = scores @ v[:, :, None] + phi_q @ kv[:, :, None]
    den = scores.sum(-1) + (phi_q * k_sum[:, :, None, None]).sum(-1)
    kv = kv + phi_k.transpose(-1, -2) @ v
    return _normalise(num, den, eps), kv, k_sum + phi_k.sum(2)


def chunk_linear_attn(phi_q, phi_k, v, kv, k_sum, eps: float = 1e-6, chunk_size: int = 64) -> Forms:
    outs = []
    for start in range(0, phi_k.shape[2], chunk_size):
        end = start + chunk_size
        out, kv, k_sum = parallel_linear_attn(
            phi_q[:, :, :, start:end], phi_k[:, :, start:end], v[:, :, start:end], kv, k_sum, eps
        )
        outs.append(out)
    return torch.cat(outs, dim=3), kv, k_sum


def step_linear_attn(phi_q, phi_k, v, kv, k_sum, eps: float = 1e-6) -> Forms:
    kv = kv + phi_k.transpose(-1, -2) @ v  # T == 1: the outer product phi(k)^T v
    k_sum = k_sum + phi_k[:, :, 0]
    num = phi_q @ kv[:, :, None]
    den = (phi_q * k_sum[:, :, None, None]).sum(-1)
    return _normalise(num, den, eps), kv, k_sum


class LinearCell(Cell):
    """Training-free linear attention with a fixed feature map and normaliser."""

    target = "linear"
    state_names = ("kv", "k_sum")

    def __init__(self, spec: CellSpec, feature_map: str = "elu", chunk_size: int = 64, eps: float = 1e-6):
        super().__init__(spec)
        self.phi = build_feature_map(feature_map, spec)
        self.feature_map, self.chunk_size, self.eps = feature_map, chunk_size, eps

    def options(self) -> dict[str, Any]:
        return {"feature_map": self.feature_map, "chunk_size": self.chunk_size, "eps": self.eps}

    def init_state(self, batch_size, device, dtype):
        spec, f = self.spec, self.phi.feature_dim
        return (
            torch.zeros(batch_size, spec.num_kv_heads, f, spec.value_dim, device=device, dtype=torch.float32),
            torch.zeros(batch_size, spec.num_kv_heads, f, device=device, dtype=torch.float32),
        )

    def features(self, q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """phi(q) grouped per kv head ``[B, H_kv, G, T, F]``, and phi(k) with padding keys zeroed, in fp32."""
        batch, _, length, _ = q.shape
        grouped = q.float().reshape(batch, self.spec.num_kv_heads, self.spec.group_size, length, -1)
        return self.phi(grouped), self.phi(k.float()) * mask[:, None, :, None].to(torch.float32)

    def forward(self, q, k, v, mask, kv, k_sum):
        phi_q, phi_k = self.features(q, k, mask)
        v = v.float()
        if q.shape[2] == 1:
            out, kv, k_sum = step_linear_attn(phi_q, phi_k, v, kv, k_sum, self.eps)
        else:
            out, kv, k_sum = chunk_linear_attn(phi_q, phi_k, v, kv, k_sum, self.eps, self.chunk_size)
        return out.reshape(q.shape[0], self.spec.num_heads, q.shape[2], -1).to(q.dtype), kv, k_sum
