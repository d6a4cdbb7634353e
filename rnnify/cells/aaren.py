"""Aaren: attention with a learned query, as an RNN ("Attention as an RNN", Feng et al. 2024, docs/math.md §Aaren).

Softmax attention of one FIXED query q^ over keys 1..t is a many-to-one RNN with a constant
state (running max m, denominator u, numerator w), per query head. Aaren makes the query of each
layer and head a learned vector, so every prefix 1..t is read by the same query and the outputs
o_1..o_T of a sequence are a prefix scan of that recurrence:

    s_t = scale * q^ . k_t                              q^: nn.Parameter [H, d], not a function of the token
    m_t = max(m_{t-1}, s_t)
    u_t = u_{t-1} exp(m_{t-1} - m_t) + exp(s_t - m_t)
    w_t = w_{t-1} exp(m_{t-1} - m_t) + v_t exp(s_t - m_t)
    o_t = w_t / u_t                                     start: m = -inf, u = 0, w = 0

with the associative (and commutative) operator, leaf t = (s_t, 1, v_t):

    (mA, uA, wA) (+) (mB, uB, wB) = (m, uA e^{mA-m} + uB e^{mB-m}, wA e^{mA-m} + wB e^{mB-m}),  m = max(mA, mB)

Its identity is (-inf, 0, 0), which is also what a padding token contributes (score -inf).
Where m is -inf (nothing read yet) the exponents use 0 instead, so -inf - -inf never appears.

The per-token query the cell receives is IGNORED: at an Aaren layer the model's q projection
(and RoPE on q) still runs in the graph but its result is unused. Keys keep their projection and
RoPE, so scores depend on the position of each key. Approximate: the outputs are those of the
original model only if every query of the layer were q^; quality needs training of q^ (and
usually the rest of the model). Initialisation: zeros (uniform attention: o_t is the running mean
of the values), or ``calibrate(q)``: the mean query of a calibration batch.

Forms, all computing the same thing (tests hold them to ``naive_recurrent_aaren``):
``naive_recurrent_*`` (a plain loop, the ground truth), ``parallel_*`` (masked quadratic: the
cumulative softmax weights of the scores under a causal mask), ``scan_*`` (Hillis-Steele
log-depth prefix scan with the operator above: how the paper trains), ``chunk_*`` (O(T * C):
quadratic inside chunks of C tokens, the state carried between them; the prefill path) and
``step_*`` (one token; the decode path) and ``fused_*`` (``rnnify.kernels.aaren_scan``, both
phases, once ``use_kernels`` is set). Shapes: scores s ``[B, Hkv, G, T]`` in fp32 (-inf on
padding), v ``[B, Hkv, T, Dv]`` (zero on padding), state m, u ``[B, Hkv, G]`` and
w ``[B, Hkv, G, Dv]`` in fp32; every form returns ``(o [B, Hkv, G, T, Dv], m, u, w)``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from rnnify import kernels
from rnnify.cells.base import Cell, CellSpec
from rnnify.cells.online_softmax import finite_or_zero, online_softmax_update, readout
from rnnify.errors import check_int

Forms = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]

PREFILL_FORMS = ("chunk", "scan")


def combine(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """The scan operator (mA, uA, wA) (+) (mB, uB, wB); w has one more (last) dimension than m and u."""
    (m_a, u_a, w_a), (m_b, u_b, w_b) = a, b
    m = torch.maximum(m_a, m_b)
    e_a, e_b = torch.exp(m_a - finite_or_zero(m)), torch.exp(m_b - finite_or_zero(m))
    return m, u_a * e_a + u_b * e_b, w_a * e_a[..., None] + w_b * e_b[..., None]


def _shift(x: torch.Tensor, offset: int, fill: float, dim: int) -> torch.Tensor:
    """x moved ``offset`` places later along ``dim`` (the last ones drop off), ``fill`` in front."""
    front = x.narrow(dim, 0, offset)
    return torch.cat([torch.full_like(front, fill), x.narrow(dim, 0, x.shape[dim] - offset)], dim=dim)


def naive_recurrent_aaren(s, v, m, u, w) -> Forms:
    outs = []
    for t in range(s.shape[-1]):
        s_t, v_t = s[..., t], v[:, :, None, t]  # [B, Hkv, G], [B, Hkv, 1, Dv]
        m, u, w = online_softmax_update(m, u, w, s_t[..., None], v_t)  # rows: the G queries, one key
        outs.append(readout(u, w))
    return torch.stack(outs, dim=3), m, u, w


def parallel_aaren(s, v, m, u, w) -> Forms:
    length = s.shape[-1]
    causal = torch.ones(length, length, dtype=torch.bool, device=s.device).tril()
    m_t = torch.maximum(m[..., None], torch.cummax(s, dim=-1).values)  # running max at each t
    ref = finite_or_zero(m_t)[..., None]  # [B, Hkv, G, T, 1]
    p = torch.exp(s[..., None, :].masked_fill(~causal, float("-inf")) - ref)  # [B, Hkv, G, T(query), T(key)]
    carry = torch.exp(m[..., None] - ref[..., 0])  # weight of the initial state at each t
    u_t = u[..., None] * carry + p.sum(-1)
    w_t = w[..., None, :] * carry[..., None] + p @ v[:, :, None]
    return readout(u_t, w_t), m_t[..., -1], u_t[..., -1], w_t[..., -1, :]


def scan_aaren(s, v, m, u, w) -> Forms:
    # leaves (s_t, 1, v_t), written as (s_t, e^{s_t - s_t}, v_t e^{s_t - s_t}) so padding (s = -inf) is the identity
    length = s.shape[-1]
    p = torch.exp(s - finite_or_zero(s))
    x = (s, p, p[..., None] * v[:, :, None])  # w: [B, Hkv, G, T, Dv]
    offset = 1
    while offset < length:  # Hillis-Steele: after this step x[t] = leaves max(0, t-2*offset+1)..t
        m_x, u_x, w_x = x
        earlier = (_shift(m_x, offset, float("-inf"), -1), _shift(u_x, offset, 0.0, -1), _shift(w_x, offset, 0.0, -2))
        x = combine(earlier, x)  # x[t - offset] (+) x[t]; the identity (-inf, 0, 0) before the start
        offset *= 2
    m_t, u_t, w_t = combine((m[..., None], u[..., None], w[..., None, :]), x)  # then the initial state
    return readout(u_t, w_t), m_t[..., -1], u_t[..., -1], w_t[..., -1, :]


def chunk_aaren(s, v, m, u, w, chunk_size: int = 64) -> Forms:
    outs = []
    for start in range(0, s.shape[-1], chunk_size):
        end = start + chunk_size
        out, m, u, w = parallel_aaren(s[..., start:end], v[:, :, start:end], m, u, w)
        outs.append(out)
    return torch.cat(outs, dim=3), m, u, w


def step_aaren(s, v, m, u, w) -> Forms:
    p = torch.exp(s[..., 0] - finite_or_zero(s[..., 0]))  # T == 1: the leaf (s, 1, v), or the identity on padding
    m, u, w = combine((m, u, w), (s[..., 0], p, p[..., None] * v[:, :, None, 0]))
    return readout(u, w)[:, :, :, None], m, u, w


def fused_aaren(s, v, m, u, w, backend: str = "auto") -> Forms:
    """The scan through ``rnnify.kernels.aaren_scan``, whose heads are this layout's (kv head, G)
    pairs flattened: scores ``[B, T, H]``, values repeated per query head ``[B, T, H, Dv]``."""
    batch, num_kv_heads, group, length = s.shape
    heads = num_kv_heads * group
    values = v[:, :, None].expand(-1, -1, group, -1, -1).reshape(batch, heads, length, -1)
    state = (m.reshape(batch, heads), u.reshape(batch, heads), w.reshape(batch, heads, -1))
    o, (m, u, w) = kernels.aaren_scan(
        s.reshape(batch, heads, length).transpose(1, 2), values.transpose(1, 2), state, True, backend=backend
    )
    grouped = (batch, num_kv_heads, group)
    o = o.transpose(1, 2).reshape(*grouped, length, -1)
    return o, m.reshape(grouped), u.reshape(grouped), w.reshape(*grouped, -1)


class AarenCell(Cell):
    """Softmax attention of a learned per-head query over the prefix: constant state, trainable."""

    target = "aaren"
    own_forms_without_triton = frozenset({"prefill", "decode"})
    state_names = ("m", "u", "w")
    uses_query = False
    calibrates = True

    def __init__(self, spec: CellSpec, chunk_size: int = 64, prefill: str = "chunk"):
        super().__init__(spec)
        check_int("chunk_size", chunk_size)
        if prefill not in PREFILL_FORMS:
            raise ValueError(f"unknown prefill form {prefill!r}; choose from {list(PREFILL_FORMS)}")
        self.chunk_size, self.prefill = chunk_size, prefill
        self.query = nn.Parameter(torch.zeros(spec.num_heads, spec.head_dim))  # q^, zeros: uniform attention

    def options(self) -> dict[str, Any]:
        return {"chunk_size": self.chunk_size, "prefill": self.prefill}

    def describe(self) -> str:
        return "learned query per head (the layer's q projection is unused)"

    def fused_ops(self) -> dict[str, str]:
        return {"prefill": "aaren_scan", "decode": "aaren_scan"}

    def init_state(self, batch_size, device, dtype):
        heads, f32 = self.spec.num_heads, torch.float32
        return (
            torch.full((batch_size, heads), float("-inf"), device=device, dtype=f32),
            torch.zeros(batch_size, heads, device=device, dtype=f32),
            torch.zeros(batch_size, heads, self.spec.value_dim, device=device, dtype=f32),
        )

    @torch.no_grad()
    def calibrate(self, q: torch.Tensor, mask: torch.Tensor | None = None) -> AarenCell:
        """Set q^ to the mean of ``q [B, H, T, d]`` (as the cell receives it) over batch and real tokens."""
        q = q.float()
        if mask is None:
            mean = q.mean(dim=(0, 2))
        else:
            real = mask.to(torch.bool)[:, None, :, None]  # [B, 1, T, 1]
            if not real.any():
                raise ValueError("calibrate: the mask has no real token")
            mean = torch.where(real, q, 0.0).sum(dim=(0, 2)) / real.sum(dim=(0, 2))
        self.query.copy_(mean.to(self.query.dtype))
        return self

    def scores(self, k: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """s = scale * q^ . k ``[B, H_kv, G, T]`` in fp32, -inf on padding."""
        spec = self.spec
        query = self.query.float().reshape(spec.num_kv_heads, spec.group_size, spec.head_dim)
        s = torch.einsum("hgd,bhtd->bhgt", query, k.float()) * spec.scale
        return s.masked_fill(~mask.to(torch.bool)[:, None, None, :], float("-inf"))

    def forward(self, q, k, v, mask, m, u, w):
        spec, batch, length = self.spec, q.shape[0], q.shape[2]  # q itself is not used: the query is learned
        s = self.scores(k, mask)
        v = torch.where(mask.to(torch.bool)[:, None, :, None], v.float(), 0.0)
        grouped = (spec.num_kv_heads, spec.group_size)
        state = (m.reshape(batch, *grouped), u.reshape(batch, *grouped), w.reshape(batch, *grouped, -1))
        backend = self.backend(q, length)
        if backend is not None:
            out, m, u, w = fused_aaren(s, v, *state, backend=backend)
        elif length == 1:
            out, m, u, w = step_aaren(s, v, *state)
        elif self.prefill == "scan":
            out, m, u, w = scan_aaren(s, v, *state)
        else:
            out, m, u, w = chunk_aaren(s, v, *state, chunk_size=self.chunk_size)
        out = out.reshape(batch, spec.num_heads, length, -1).to(q.dtype)
        return out, m.reshape(batch, -1), u.reshape(batch, -1), w.reshape(batch, spec.num_heads, -1)
