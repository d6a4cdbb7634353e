"""The score terms a model adds to softmax attention, in the exact and window cells
(docs/math.md §Score terms): softcap c tanh(s / c), ALiBi slope_h (j - i) and learned sinks
exp(sink_h) in each denominator, every form against a float64 loop written here from the
equations, prefill and steps, padding and the spec's own checks."""

from __future__ import annotations

import pytest
import torch

from rnnify.cells import build_cell
from rnnify.cells.base import CellSpec
from rnnify.cells.exact import ExactCell, naive_recurrent_softmax_attn, parallel_softmax_attn, scored_softmax_attn
from rnnify.cells.online_softmax import score_terms
from rnnify.cells.window import (
    WindowCell,
    chunk_window_attn,
    naive_recurrent_window_attn,
    parallel_window_attn,
    step_window_attn,
)
from rnnify.errors import RnnifyError

HEADS, KV_HEADS, DIM, SCALE = 4, 2, 8, 0.4
TERMS = {
    "softcap": {"softcap": 2.0},
    "alibi": {"alibi_slopes": (0.5, 0.25, 0.125, -0.0625)},
    "sinks": {"sink_logits": (1.5, -0.5, 0.0, 3.0)},
    "all": {"softcap": 2.0, "alibi_slopes": (0.5, 0.25, 0.125, -0.0625), "sink_logits": (1.5, -0.5, 0.0, 3.0)},
}


def spec_with(terms: str) -> CellSpec:
    return CellSpec(HEADS, KV_HEADS, DIM, DIM, SCALE, **TERMS[terms])


def problem(batch: int = 2, length: int = 13, padding: int = 3, seed: int = 0):
    """q [B, H, T, d], k, v [B, Hkv, T, d] (float64, scores of a few units: the softcap bends them),
    mask [B, T] with row 1 left-padded."""
    gen = torch.Generator().manual_seed(seed)
    q = 2 * torch.randn(batch, HEADS, length, DIM, generator=gen, dtype=torch.float64)
    k = torch.randn(batch, KV_HEADS, length, DIM, generator=gen, dtype=torch.float64)
    v = torch.randn(batch, KV_HEADS, length, DIM, generator=gen, dtype=torch.float64)
    mask = torch.ones(batch, length, dtype=torch.bool)
    mask[1, :padding] = False
    return q, k, v, mask


def reference(q, k, v, mask, spec: CellSpec, window: int | None = None, sinks: int = 0) -> torch.Tensor:
    """The equations one query, head and key at a time, float64: query i of a row attends to its real
    keys j <= i (the last ``window`` and the first ``sinks`` of them when ``window`` is given), with
    score c tanh(s / c) + slope (j - i), j and i counted in real tokens, and exp(sink) added to the
    denominator. Padding queries give 0."""
    out = torch.zeros_like(q)
    group = HEADS // KV_HEADS
    for b in range(q.shape[0]):
        position = mask[b].long().cumsum(0) - 1
        for h in range(HEADS):
            for i in range(q.shape[2]):
                if not mask[b, i]:
                    continue
                keys = [
                    j
                    for j in range(i + 1)
                    if mask[b, j] and (window is None or position[i] - position[j] < window or position[j] < sinks)
                ]
                s = torch.stack([SCALE * q[b, h, i] @ k[b, h // group, j] for j in keys])
                if spec.softcap is not None:
                    s = spec.softcap * torch.tanh(s / spec.softcap)
                if spec.alibi_slopes is not None:
                    s = s + spec.alibi_slopes[h] * (position[keys] - position[i]).double()
                top = s.max()
                if spec.sink_logits is not None:
                    top = torch.maximum(top, torch.tensor(spec.sink_logits[h], dtype=torch.float64))
                weights = torch.exp(s - top)
                denominator = weights.sum()
                if spec.sink_logits is not None:
                    denominator = denominator + torch.exp(spec.sink_logits[h] - top)
                out[b, h, i] = (weights[:, None] * v[b, h // group, keys]).sum(0) / denominator
    return out


def real(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``x [B, H, T, d]`` at real tokens only (0 at padding)."""
    return x * mask[:, None, :, None]


def test_the_terms_change_the_output():
    """Every term moves the reference well past the tolerances below: the checks can fail."""
    q, k, v, mask = problem()
    plain = reference(q, k, v, mask, CellSpec(HEADS, KV_HEADS, DIM, DIM, SCALE))
    for name in TERMS:
        assert (reference(q, k, v, mask, spec_with(name)) - plain).abs().max() > 1e-2, name


@pytest.mark.parametrize("terms", list(TERMS))
def test_exact_forms_equal_the_float64_loop(terms):
    spec = spec_with(terms)
    q, k, v, mask = problem()
    want = reference(q, k, v, mask, spec)
    scored = score_terms(spec).double()
    for name, form in {
        "naive_recurrent": lambda: naive_recurrent_softmax_attn(q, k, v, mask, SCALE, None, scored),
        "parallel": lambda: parallel_softmax_attn(q, k, v, mask, SCALE, None, scored),
        "scored, blocks of 5": lambda: scored_softmax_attn(q, k, v, mask, SCALE, scored, None, 5),
    }.items():
        assert (real(form(), mask) - want).abs().max() < 1e-6, name  # the first two accumulate in fp32


@pytest.mark.parametrize("terms", list(TERMS))
@pytest.mark.parametrize("window", [None, 4])
def test_exact_cell_prefill_and_steps_equal_the_float64_loop(terms, window):
    spec = CellSpec(HEADS, KV_HEADS, DIM, DIM, SCALE, window, **TERMS[terms])
    q, k, v, mask = problem()
    want = reference(q, k, v, mask, spec, window=window)
    cell = ExactCell(spec, block_size=4).double()
    state = cell.init_state(2, torch.device("cpu"), torch.float64)
    prefill, *_ = cell(q, k, v, mask, *state)
    assert (real(prefill, mask) - want).abs().max() < 1e-10
    split, *state = cell(q[:, :, :6], k[:, :, :6], v[:, :, :6], mask[:, :6], *state)
    outs = [split]
    for t in range(6, q.shape[2]):
        out, *state = cell(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], mask[:, t : t + 1], *state)
        outs.append(out)
    assert (real(torch.cat(outs, 2), mask) - want).abs().max() < 1e-10


@pytest.mark.parametrize("terms", list(TERMS))
@pytest.mark.parametrize(("window", "sinks"), [(4, 0), (4, 2), (16, 0)])
def test_window_forms_equal_the_float64_loop(terms, window, sinks):
    spec = spec_with(terms)
    q, k, v, mask = problem()
    want = reference(q, k, v, mask, spec, window=window, sinks=sinks)
    cell = WindowCell(spec, window=window, sinks=sinks, block_size=3).double()
    state = cell.init_state(2, torch.device("cpu"), torch.float64)
    grouped = q.float().reshape(2, KV_HEADS, HEADS // KV_HEADS, q.shape[2], DIM)  # the forms read q in fp32
    shape = q.shape
    for name, form in {
        "naive_recurrent": lambda: naive_recurrent_window_attn(grouped, k, v, mask, *state, SCALE, cell.terms),
        "parallel": lambda: parallel_window_attn(grouped, k, v, mask, *state, SCALE, cell.terms),
        "chunk": lambda: chunk_window_attn(grouped, k, v, mask, *state, SCALE, 5, cell.terms),
    }.items():
        out, *_ = form()
        assert (real(out.reshape(shape), mask) - want).abs().max() < 1e-5, name
    outs, step_state = [], state
    for t in range(q.shape[2]):
        one = (grouped[:, :, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], mask[:, t : t + 1])
        out, *step_state = step_window_attn(*one, *step_state, SCALE, cell.terms)
        outs.append(out)
    assert (real(torch.cat(outs, 3).reshape(shape), mask) - want).abs().max() < 1e-5, "step"


@pytest.mark.parametrize("terms", list(TERMS))
def test_window_cell_prefill_and_steps_equal_the_float64_loop(terms):
    spec = spec_with(terms)
    q, k, v, mask = problem()
    want = reference(q, k, v, mask, spec, window=4, sinks=2)
    cell = WindowCell(spec, window=4, sinks=2).double()
    state = cell.init_state(2, torch.device("cpu"), torch.float64)
    # the cell reads q in float32, as it does a model's
    prefill, *_ = cell(q, k, v, mask, *state)
    assert (real(prefill, mask) - want).abs().max() < 1e-5
    split, *state = cell(q[:, :, :5], k[:, :, :5], v[:, :, :5], mask[:, :5], *state)
    outs = [split]
    for t in range(5, q.shape[2]):
        out, *state = cell(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], mask[:, t : t + 1], *state)
        outs.append(out)
    assert (real(torch.cat(outs, 2), mask) - want).abs().max() < 1e-5


def test_a_cell_with_terms_runs_no_kernel_that_ignores_them():
    cell = WindowCell(spec_with("all"), window=4)
    assert cell.use_kernels("reference") == {} and cell.kernels is None
    assert WindowCell(CellSpec(HEADS, KV_HEADS, DIM, DIM, SCALE), window=4).use_kernels("reference")


@pytest.mark.parametrize("target", ["linear", "gated", "hybrid", "aaren", "delta", "select"])
@pytest.mark.parametrize("terms", list(TERMS))
def test_targets_that_cannot_compute_a_term_refuse_it(target, terms):
    with pytest.raises(RnnifyError, match=rf"target '{target}': cannot compute this attention's .*; exact and window"):
        build_cell(target, spec_with(terms), {"window": 4} if target in ("hybrid", "select") else {})


def test_a_split_by_heads_refuses_a_group_that_cannot_compute_the_terms():
    groups = [{"kv_heads": [0], "target": "exact"}, {"kv_heads": [1], "target": "linear"}]
    with pytest.raises(RnnifyError, match="target 'linear': cannot compute this attention's ALiBi position bias"):
        build_cell("heads", spec_with("alibi"), {"groups": groups})


def test_the_spec_keeps_its_terms_through_json():
    spec = spec_with("all")
    assert CellSpec(**spec.to_json()) == spec
    assert spec.score_terms == {"softcap", "alibi_slopes", "sink_logits"}
    plain = CellSpec(HEADS, KV_HEADS, DIM, DIM, SCALE)
    assert set(plain.to_json()) == {
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "value_dim",
        "scale",
        "window",
        "hidden_size",
    }


@pytest.mark.parametrize(
    ("terms", "message"),
    [
        ({"softcap": 0.0}, "softcap must be a positive number"),
        ({"alibi_slopes": (0.5, 0.25)}, "alibi_slopes must be 4 finite numbers"),
        ({"sink_logits": (1.0, float("nan"), 0.0, 0.0)}, "sink_logits must be 4 finite numbers"),
    ],
)
def test_the_spec_refuses_bad_terms(terms, message):
    with pytest.raises(ValueError, match=message):
        CellSpec(HEADS, KV_HEADS, DIM, DIM, SCALE, **terms)
