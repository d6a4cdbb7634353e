"""A relative position bias each query brings (Inkling's) converts exactly
(rnnify/compiler/passes/find_relative.py, ``ScoreTerms.scores``' ``relative``).

Inkling's tiny models here keep a table 12 distances wide on their global layers and a window of 8
on their sliding ones, scale the tables up so the bias moves the logits far past the tolerance (the
original with the tables zeroed differs by more than 1e-3, so a conversion that dropped the bias
would fail), and log-scale their global layers from the fourth position (the factor per query).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import transformers
from support import (
    assert_left_padded_rows_equal_rows_alone,
    assert_round_trips_a_save,
    decode,
    original_logits,
    rel_diff,
)

import rnnify
from rnnify.cells import CellSpec, build_cell
from rnnify.errors import RnnifyError, RnnifyWarning

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from arch_configs import overrides  # noqa: E402

EXTENT, WINDOW, LENGTH = 12, 8, 40
INKLING = dict(rel_extent=EXTENT, sliding_window_size=WINDOW, log_scaling_n_floor=4, log_scaling_alpha=0.5)


def _inkling(model_type: str = "inkling_text", tables: float = 30.0):
    """The tiny Inkling of ``model_type`` (a whole's text config takes ``INKLING``) with its relative
    tables times ``tables``."""
    config_class = transformers.CONFIG_MAPPING[model_type]
    values = overrides(config_class(), model_type)
    whole = "text_config" in values
    if whole:
        values["text_config"] = {**values["text_config"], **INKLING}
    config = config_class(**(values if whole else {**values, **INKLING}))
    torch.manual_seed(0)
    auto = transformers.AutoModelForMultimodalLM if whole else transformers.AutoModelForCausalLM
    model = auto.from_config(config).eval()
    with torch.no_grad():
        for name, table in model.named_parameters():
            if name.endswith("rel_logits_proj.proj"):
                table.mul_(tables)
    return model


def _ids(length: int = LENGTH, batch: int = 2) -> torch.Tensor:
    return torch.randint(3, 100, (batch, length), generator=torch.Generator().manual_seed(length))


@pytest.fixture(scope="module")
def inkling():
    source = _inkling()
    return source, rnnify.convert(source, to="exact")


def test_the_bias_moves_the_tiny_models_logits():
    """Without it the tests below could not fail: the same model with zero tables differs."""
    ids = _ids()
    assert rel_diff(original_logits(_inkling(tables=0.0), ids), original_logits(_inkling(), ids)) > 1e-3


def test_exact_equals_the_original_prefill_and_steps_past_the_extent(inkling):
    source, model = inkling
    extents = sorted({cell.spec.relative_extent for cell in model.cells if cell.target == "exact"})
    assert extents == [WINDOW, EXTENT]  # the sliding layers' table is their window wide
    ids = _ids()
    want = original_logits(source, ids)
    assert rel_diff(model.prefill(ids)[0], want) < 1e-5
    assert rel_diff(decode(model, ids, 5)[0], want) < 1e-5


def test_left_padded_rows_equal_rows_alone_and_a_save_round_trips(inkling, tmp_path):
    """Distances count a row's real tokens, so padding shifts no query's table."""
    _, model = inkling
    assert_left_padded_rows_equal_rows_alone(model, [3, 30, 17], torch.Generator().manual_seed(1), steps=5)
    loaded = assert_round_trips_a_save(model, tmp_path / "inkling", _ids())
    assert {cell.spec.relative_extent for cell in loaded.cells if cell.target == "exact"} == {WINDOW, EXTENT}


def test_the_composite_converts_to_its_language_model_exactly():
    whole = _inkling("inkling_mm_model")
    with pytest.warns(RnnifyWarning):
        model = rnnify.convert(whole, to="exact")
    ids = _ids()
    assert rel_diff(decode(model, ids, 20)[0], original_logits(whole, ids)) < 1e-5


@pytest.mark.parametrize("target", ["window", "heads"])
def test_targets_other_than_exact_refuse_the_bias_in_one_line(target):
    layers = {"heads": "0-:heads(0=exact;1=exact)"}.get(target)
    with pytest.raises(RnnifyError, match="relative position bias per query; exact can") as caught:
        rnnify.convert(_inkling(), to="exact" if layers else target, layers=layers)
    assert "\n" not in str(caught.value)


def test_auto_and_vllm_refuse_the_bias_in_one_line(inkling, tmp_path):
    from rnnify.auto.graph_probe import probe_runner
    from rnnify.integrations.vllm.hosting import check_hostable

    source, model = inkling
    with pytest.raises(
        RnnifyError, match=r"^--to auto: layer 0 adds to its scores what its tokens compute \(position_bias\)"
    ):
        probe_runner(source, torch.float32, _ids(8))
    with pytest.raises(
        RnnifyError, match=r"relative position bias each query brings \(Inkling's\), which rnnify's vLLM"
    ):
        check_hostable(model.save(tmp_path / "inkling"))


def test_a_table_gathered_by_another_distance_is_refused(monkeypatch):
    """Buckets of two distances a table entry: not the bias the cell computes, refused by name."""
    from transformers.models.inkling import modeling_inkling

    forward = modeling_inkling.InklingRelativeLogits.forward

    def bucketed(self, relative_states, query_positions, key_positions):
        return forward(self, relative_states, query_positions // 2 * 2, key_positions // 2 * 2)

    monkeypatch.setattr(modeling_inkling.InklingRelativeLogits, "forward", bucketed)
    with pytest.raises(RnnifyError, match="gathers a table by something other than the distance"):
        rnnify.convert(_inkling(), to="exact")


def _textbook(q, k, v, valid, relative, scale: float, extent: int, window: int | None) -> torch.Tensor:
    """Each real query's softmax over the real keys it reads, in float64, one at a time, with
    r_i[i - j] added where i - j < E, i and j counted in the row's real tokens."""
    batch, heads, length, _ = q.shape
    group = heads // k.shape[1]
    out = torch.zeros(batch, heads, length, v.shape[-1], dtype=torch.float64)
    for b in range(batch):
        real = valid[b].nonzero().flatten().tolist()
        for i, t in enumerate(real):
            keys = [(j, s) for j, s in enumerate(real[: i + 1]) if window is None or i - j < window]
            for h in range(heads):
                scores = torch.stack(
                    [
                        scale * q[b, h, t].double() @ k[b, h // group, s].double()
                        + (relative[b, h, t, i - j].double() if i - j < extent else 0.0)
                        for j, s in keys
                    ]
                )
                weights = scores.softmax(0)
                out[b, h, t] = sum(w * v[b, h // group, s].double() for w, (_, s) in zip(weights, keys))
    return out


@pytest.mark.parametrize("window", [None, 5])
def test_the_exact_cell_adds_each_querys_table_as_the_textbook_loop_does(window):
    """Left padding, grouped heads, a prompt then steps, distances past the table's width."""
    spec = CellSpec(4, 2, 8, 8, 8**-0.5, window, relative_extent=6)
    cell = build_cell("exact", spec)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 15, 8, generator=gen) for h in (4, 2, 2))
    relative = 3 * torch.randn(2, 4, 15, 6, generator=gen)
    valid = torch.ones(2, 15, dtype=torch.bool)
    valid[1, :4] = False
    want = _textbook(q, k, v, valid, relative, spec.scale, 6, window)
    state = cell.init_state(2, q.device, torch.float32)
    out, *state = cell(q[:, :, :9], k[:, :, :9], v[:, :, :9], valid[:, :9], *state, relative=relative[:, :, :9])
    outs = [out]
    for t in range(9, 15):
        step = slice(t, t + 1)
        qkv = (x[:, :, step] for x in (q, k, v))
        out, *state = cell(*qkv, valid[:, step], *state, relative=relative[:, :, step])
        outs.append(out)
    got = torch.cat(outs, dim=2)
    for row in range(2):  # the queries of real tokens (a padded query's output is the forms' to choose)
        real = valid[row]
        torch.testing.assert_close(got[row][:, real].double(), want[row][:, real], rtol=1e-5, atol=1e-5)
