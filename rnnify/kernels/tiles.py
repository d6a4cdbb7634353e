"""Triton building blocks the kernels share, inlined where they are called (fla's ``ops/utils``).

A tensor is read as rows of C columns, its last axis: token t of batch row b and head h of
k ``[B, T, H_kv, K]`` is row ``(b T + t) H_kv + h``, and row ``i_bh K + i`` of a state
``[B, H_kv, K, V]`` is row i of state i_bh. Loads return fp32 with 0 outside the masks; stores
cast to the tensor's dtype.
"""

from __future__ import annotations

from rnnify.kernels.utils import tl, triton

if triton is not None:

    @triton.jit
    def load_rows(p, i_r, o_c, m_r, C: tl.constexpr):
        """Rows ``i_r`` [BR] where ``m_r``, columns ``o_c`` [BC] below C, of ``p`` [*, C] -> fp32 [BR, BC]."""
        m = m_r[:, None] & (o_c < C)[None, :]
        return tl.load(p + i_r[:, None] * C + o_c[None, :], mask=m, other=0.0).to(tl.float32)

    @triton.jit
    def store_rows(p, b, i_r, o_c, m_r, C: tl.constexpr):
        """``b`` [BR, BC] into rows ``i_r`` where ``m_r``, columns ``o_c`` below C, of ``p`` [*, C]."""
        m = m_r[:, None] & (o_c < C)[None, :]
        tl.store(p + i_r[:, None] * C + o_c[None, :], b.to(p.dtype.element_ty), mask=m)

    @triton.jit
    def load_row(p, i_r, o_c, C: tl.constexpr):
        """Row ``i_r`` (one index), columns ``o_c`` [BC] below C, of ``p`` [*, C] -> fp32 [BC]."""
        return tl.load(p + i_r * C + o_c, mask=o_c < C, other=0.0).to(tl.float32)

    @triton.jit
    def store_row(p, b, i_r, o_c, C: tl.constexpr):
        """``b`` [BC] into row ``i_r``, columns ``o_c`` below C, of ``p`` [*, C]."""
        tl.store(p + i_r * C + o_c, b.to(p.dtype.element_ty), mask=o_c < C)

    @triton.jit
    def value_block_program(HEADS: tl.constexpr, BV: tl.constexpr):
        """Where a program of a (value blocks, batch x heads) grid works: ``(i_v, i_bh, i_b, i_h, o_v)``,
        its value block, batch x head, batch row and head (int64, so offsets cannot overflow), and its
        BV value columns."""
        i_v, i_bh = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
        return i_v, i_bh, i_bh // HEADS, i_bh % HEADS, i_v * BV + tl.arange(0, BV)

    @triton.jit
    def chunk_tokens(i_b, i_t, T, BT: tl.constexpr):
        """The rows (b T + t) of chunk ``i_t``'s BT tokens in batch row ``i_b``, and which of them are
        in the sequence (t < T)."""
        o_t = i_t * BT + tl.arange(0, BT)
        return i_b * T + o_t, o_t < T

    @triton.jit
    def load_state(p, i_bh, o_k, o_v, K: tl.constexpr, V: tl.constexpr):
        """Rows ``o_k`` [BK] below K, columns ``o_v`` [BV] below V, of state ``i_bh`` of ``p``
        ``[*, K, V]`` -> fp32 [BK, BV] (``load_rows``' block, its offsets within a state in 32 bits)."""
        m = (o_k < K)[:, None] & (o_v < V)[None, :]
        return tl.load(p + i_bh * K * V + o_k[:, None] * V + o_v[None, :], mask=m, other=0.0).to(tl.float32)

    @triton.jit
    def store_state(p, b_h, i_bh, o_k, o_v, K: tl.constexpr, V: tl.constexpr):
        """``b_h`` [BK, BV] into rows ``o_k`` below K, columns ``o_v`` below V, of state ``i_bh`` of ``p``."""
        m = (o_k < K)[:, None] & (o_v < V)[None, :]
        tl.store(p + i_bh * K * V + o_k[:, None] * V + o_v[None, :], b_h.to(p.dtype.element_ty), mask=m)

    @triton.jit
    def initial_state(h0, i_bh, o_k, o_v, K: tl.constexpr, V: tl.constexpr, USE_INITIAL_STATE: tl.constexpr):
        """The block [BK, BV] of state ``i_bh`` a recurrence starts from: h0's ``[*, K, V]``, or 0."""
        b_h = tl.zeros([o_k.shape[0], o_v.shape[0]], dtype=tl.float32)
        if USE_INITIAL_STATE:
            b_h += load_state(h0, i_bh, o_k, o_v, K, V)
        return b_h

    @triton.jit
    def decay(
        b_h, g, gk, i_r, o_k, b_real, K: tl.constexpr, USE_G: tl.constexpr, USE_GK: tl.constexpr, USE_MASK: tl.constexpr
    ):
        """a_t S: ``b_h`` [BK, BV] decayed by the log gates of row ``i_r`` (token x head), the scalar g
        ``[*]`` and the per-row gk ``[*, K]``; with ``USE_MASK``, a padding token (``b_real`` False)
        decays nothing."""
        if USE_G:
            b_g = tl.load(g + i_r).to(tl.float32)
            if USE_MASK:
                b_g = tl.where(b_real, b_g, 0.0)
            b_h = b_h * tl.exp(b_g)
        if USE_GK:
            b_gk = load_row(gk, i_r, o_k, K)
            if USE_MASK:
                b_gk = tl.where(b_real, b_gk, 0.0)
            b_h = b_h * tl.exp(b_gk)[:, None]
        return b_h
