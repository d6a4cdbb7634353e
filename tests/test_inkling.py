"""Inkling and Inkling 2 convert exactly: the relative position bias each query brings
(rnnify/compiler/passes/find_relative.py, ``ScoreTerms.scores``' ``relative``), Inkling 2's sink
logits per query (``ScoreTerms.readout``'s ``sinks``) and its convolutions whose taps each token
computes (``TokenWindowCell``).

The tiny models keep a table 12 distances wide on their global layers and a window of 8 on their
sliding ones, scale the tables (and Inkling 2's sink projections) up so they move the logits far
past the tolerance (the original with them zeroed differs by more than 1e-3, so a conversion that
dropped one would fail), and log-scale their global layers from the fourth position.
"""

from __future__ import annotations

import collections
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


def _inkling(model_type: str = "inkling_text", tables: float = 30.0, sinks: float = 30.0):
    """The tiny Inkling of ``model_type`` (a whole's text config takes ``INKLING``) with its relative
    tables times ``tables`` and its sink projections (Inkling 2's) times ``sinks``."""
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
        for name, weight in model.named_parameters():
            if name.endswith(("rel_logits_proj.proj", "relative_position_bias.proj")):
                weight.mul_(tables)
            elif name.endswith("sink_proj.weight"):
                weight.mul_(sinks)
    return model


def _ids(length: int = LENGTH, batch: int = 2) -> torch.Tensor:
    return torch.randint(3, 100, (batch, length), generator=torch.Generator().manual_seed(length))


@pytest.fixture(scope="module")
def inkling():
    source = _inkling()
    return source, rnnify.convert(source, to="exact")


@pytest.mark.parametrize(
    "model_type, zeroed", [("inkling_text", "tables"), ("inkling2_text", "tables"), ("inkling2_text", "sinks")]
)
def test_the_bias_and_the_sinks_move_the_tiny_models_logits(model_type, zeroed):
    """Without them the tests below could not fail: the same model with them zeroed differs."""
    ids = _ids()
    without = original_logits(_inkling(model_type, **{zeroed: 0.0}), ids)
    assert rel_diff(without, original_logits(_inkling(model_type), ids)) > 1e-3


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


@pytest.mark.slow  # the sweep converts the wholes too (docs/architectures.md)
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
    """``--to auto`` through transformers' attention interface and through the exact conversion
    (where the interface does not reach a model's attention), and vLLM's hosting check."""
    from rnnify.auto.graph_probe import GraphRunner, probe_runner
    from rnnify.integrations.vllm.hosting import check_hostable

    source, model = inkling
    with pytest.raises(
        RnnifyError, match=r"^--to auto: layer 0 adds to its scores what its tokens compute \(position_bias\)"
    ):
        probe_runner(source, torch.float32, _ids(8))
    with pytest.raises(RnnifyError, match=r"^--to auto: layer 0 adds to its scores terms each query brings"):
        GraphRunner(source, torch.float32)
    with pytest.raises(RnnifyError, match=r"terms each query brings \(Inkling's relative bias or sink logits\)"):
        check_hostable(model.save(tmp_path / "inkling"))


@pytest.mark.parametrize("target", ["window", "heads"])
def test_sinks_per_query_are_refused_by_targets_other_than_exact(target):
    spec = CellSpec(4, 2, 8, 8, 8**-0.5, query_sinks=True)
    options = {"groups": [{"kv_heads": [0], "target": "exact"}, {"kv_heads": [1], "target": "exact"}]}
    with pytest.raises(RnnifyError, match="attention sinks per query; exact can"):
        build_cell(target, spec, options if target == "heads" else {})


@pytest.fixture(scope="module")
def inkling2():
    source = _inkling("inkling2_text")
    return source, rnnify.convert(source, to="exact")


def test_inkling2_equals_the_original_prefill_and_steps(inkling2, tmp_path):
    """Its sinks per query and its keys' and values' per-token convolution taps, stepped (a step
    that read each token as the first would differ), left-padded and saved."""
    source, model = inkling2
    targets = collections.Counter(cell.target for cell in model.cells)
    assert targets["token_window"] == 2 and all(cell.spec.query_sinks for cell in model.cells if cell.target == "exact")
    ids = _ids()
    want = original_logits(source, ids)
    assert rel_diff(model.prefill(ids)[0], want) < 1e-5
    assert rel_diff(decode(model, ids, 5)[0], want) < 1e-5
    assert_left_padded_rows_equal_rows_alone(model, [3, 30, 17], torch.Generator().manual_seed(1), steps=5)
    assert_round_trips_a_save(model, tmp_path / "inkling2", ids)


def _bucketed(forward, self, states, q_positions, k_positions):
    return forward(self, states, q_positions // 2 * 2, k_positions // 2 * 2)


def _distance(q_positions, k_positions):
    return q_positions[:, None] - k_positions[None, :]


def _clamped(forward, self, states, q_positions, k_positions):
    """The table's last entry for every distance past its width, not 0."""
    logits = (states @ self.proj).transpose(1, 2)
    index = _distance(q_positions, k_positions).clamp(0, self.rel_extent - 1)
    return logits.gather(-1, index.expand(*logits.shape[:2], -1, -1))


# other forms a table gathered by distance could take, each differing from the bias the cell computes
# only past the probe's 9 tokens (and short of the table's 12), where no probe would see it
OTHER_FORMS = {
    "another distance": (_bucketed, "gathers a table by something other than the distance"),
    "cut short": (
        lambda f, self, s, q, k: torch.where(_distance(q, k) < 10, f(self, s, q, k), 0.0),
        "otherwise than as a relative bias per query",
    ),
    "filled with another value": (
        lambda f, self, s, q, k: f(self, s, q, k).masked_fill(_distance(q, k) >= 10, 0.5),
        "otherwise than as a relative bias per query",
    ),
    "clamped, never 0": (_clamped, "otherwise than as a relative bias per query"),
    "read twice": (
        lambda f, self, s, q, k: f(self, s, q, k) + torch.where(_distance(q, k) >= 10, f(self, s, q, k), 0.0),
        "along 2 paths",
    ),
}


@pytest.mark.parametrize("form", list(OTHER_FORMS))
def test_a_table_gathered_in_another_form_is_refused(monkeypatch, form):
    from transformers.models.inkling import modeling_inkling

    forward = modeling_inkling.InklingRelativeLogits.forward
    other, refusal = OTHER_FORMS[form]
    monkeypatch.setattr(
        modeling_inkling.InklingRelativeLogits, "forward", lambda self, *args: other(forward, self, *args)
    )
    with pytest.raises(RnnifyError, match=refusal):
        rnnify.convert(_inkling(), to="exact")


def _textbook(q, k, v, valid, relative, sinks, scale: float, extent: int, window: int | None) -> torch.Tensor:
    """Each real query's softmax over the real keys it reads, in float64, one at a time, with
    r_i[i - j] added where i - j < E, i and j counted in the row's real tokens, and exp(sink_i) in
    its denominator."""
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
                weights = scores.exp() / (scores.exp().sum() + sinks[b, h, t].double().exp())
                out[b, h, t] = sum(w * v[b, h // group, s].double() for w, (_, s) in zip(weights, keys))
    return out


@pytest.mark.parametrize("block_size", [512, 2])
@pytest.mark.parametrize("window", [None, 5])
def test_the_exact_cell_adds_each_querys_table_and_sink_as_the_textbook_loop_does(window, block_size):
    """Left padding, grouped heads, a prompt then steps, distances past the table's width, the
    prompt's queries in one block or in blocks of 2."""
    spec = CellSpec(4, 2, 8, 8, 8**-0.5, window, relative_extent=6, query_sinks=True)
    cell = build_cell("exact", spec, {"block_size": block_size})
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 15, 8, generator=gen) for h in (4, 2, 2))
    relative = 3 * torch.randn(2, 4, 15, 6, generator=gen)
    sinks = 2 * torch.randn(2, 4, 15, 1, generator=gen)
    valid = torch.ones(2, 15, dtype=torch.bool)
    valid[1, :4] = False
    want = _textbook(q, k, v, valid, relative, sinks[..., 0], spec.scale, 6, window)
    state = cell.init_state(2, q.device, torch.float32)
    outs = []
    for part in [slice(0, 9), *(slice(t, t + 1) for t in range(9, 15))]:  # a prompt, then steps
        qkv = (x[:, :, part] for x in (q, k, v))
        out, *state = cell(*qkv, valid[:, part], *state, relative=relative[:, :, part], sinks=sinks[:, :, part])
        outs.append(out)
    got = torch.cat(outs, dim=2)
    for row in range(2):  # the queries of real tokens (a padded query's output is the forms' to choose)
        real = valid[row]
        torch.testing.assert_close(got[row][:, real].double(), want[row][:, real], rtol=1e-5, atol=1e-5)
