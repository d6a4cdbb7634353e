"""Chunked attention (Llama 4's ``attention_chunk_size``): converted exactly, its state bounded by the
chunk. References: the original model, each row alone, and a float64 loop over the chunk rule."""

import sys
from pathlib import Path

import pytest
import torch

import rnnify
from rnnify.auto import HeadScorer, convert_chosen
from rnnify.cells.base import CellSpec
from rnnify.cells.exact import ExactCell
from rnnify.errors import RnnifyError
from rnnify.integrations.vllm.hosting import check_hostable
from tests.support import (
    assert_left_padded_rows_equal_rows_alone,
    assert_steps_and_split_prefill_match,
    decode,
    original_logits,
    random_qkv,
    rel_diff,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from arch_configs import build  # noqa: E402

CHUNK = 8  # arch_configs' tiny Llama 4: layer 0 attends in chunks of 8, layer 1 (no RoPE) to every key


@pytest.fixture(scope="module")
def llama4():
    model = build("llama4_text")[0]
    assert model.config.attention_chunk_size == CHUNK
    assert model.config.layer_types == ["chunked_attention", "full_attention"]
    return model


@pytest.fixture(scope="module")
def converted(llama4):
    return rnnify.convert(llama4, to="exact")


def ids(length: int, batch: int = 2, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 256, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_the_chunked_layer_is_found_with_its_chunk(converted):
    specs = {entry.layer: entry.spec for entry in converted.manifest.cells}
    assert specs[0]["chunk"] == CHUNK and specs[0]["window"] is None
    assert "chunk" not in specs[1]  # a full layer's manifest entry reads as before


def test_the_conversion_equals_the_original_across_chunk_boundaries(llama4, converted):
    tokens = ids(3 * CHUNK + 5)
    want = original_logits(llama4, tokens)
    assert rel_diff(converted.prefill(tokens)[0], want) < 1e-4
    for prefill in (1, CHUNK - 1, CHUNK, CHUNK + 3):
        assert rel_diff(decode(converted, tokens, prefill)[0], want) < 1e-4, prefill


def test_split_prefills_and_steps_agree(converted):
    for split in (3, CHUNK, CHUNK + 5):
        assert_steps_and_split_prefill_match(converted, ids(2 * CHUNK + 6), split)


def test_left_padded_rows_equal_rows_alone(converted):
    gen = torch.Generator().manual_seed(0)
    assert_left_padded_rows_equal_rows_alone(converted, [2 * CHUNK + 3, CHUNK - 2, CHUNK + 1], gen, steps=CHUNK + 2)


def test_the_chunked_layers_state_is_bounded_by_the_chunk(llama4, tmp_path):
    model = rnnify.convert(llama4, to="exact", layers="1:window", window=4, sinks=1)
    assert model.constant_memory
    assert model.state_nbytes(10 * CHUNK) == model.state_nbytes(100 * CHUNK)
    _, state = decode(model, ids(5 * CHUNK + 3), 2 * CHUNK)
    keys = state.tensors[0]  # the chunked layer's keys
    assert keys.shape[2] == CHUNK
    loaded = rnnify.load(model.save(tmp_path / "out"))
    tokens = ids(3 * CHUNK)
    assert rel_diff(decode(loaded, tokens, 5)[0], decode(model, tokens, 5)[0]) < 1e-6
    with pytest.raises(RnnifyError, match=r"attends in chunks of 8 tokens .*which rnnify's vLLM pages do not serve"):
        check_hostable(tmp_path / "out")


def chunked_reference(q, k, v, valid, scale: float, chunk: int) -> torch.Tensor:
    """float64, one query at a time: the earlier real keys of the query's own chunk, chunks counted
    in real tokens."""
    batch, heads, length, _ = q.shape
    group = heads // k.shape[1]
    out = torch.zeros(batch, heads, length, v.shape[-1], dtype=torch.float64)
    for b in range(batch):
        real = valid[b].long().cumsum(0) - 1
        for t in range(length):
            if not valid[b, t]:
                continue
            keys = [j for j in range(t + 1) if valid[b, j] and real[j] // chunk == real[t] // chunk]
            for h in range(heads):
                s = torch.stack([q[b, h, t].double() @ k[b, h // group, j].double() for j in keys]) * scale
                out[b, h, t] = torch.softmax(s, 0) @ v[b, h // group, keys].double()
    return out


def test_the_cell_computes_chunked_softmax_from_any_split():
    spec = CellSpec(num_heads=4, num_kv_heads=2, head_dim=8, value_dim=8, scale=0.35, chunk=5)
    cell = ExactCell(spec, block_size=4)
    gen = torch.Generator().manual_seed(0)
    q, k, v = random_qkv(2, spec, 17, gen)
    mask = torch.ones(2, 17, dtype=torch.bool)
    mask[1, :3] = mask[1, 6:10] = False  # a left-padded row, and padding in its second prompt
    want = chunked_reference(q, k, v, mask, spec.scale, spec.chunk)
    for pieces in ([17], [6, 11], [1] * 17, [5, 5, 7], [3, 3, 11]):
        state, outs, at = cell.init_state(2, "cpu", torch.float32), [], 0
        for n in pieces:
            out, *state = cell(
                q[:, :, at : at + n], k[:, :, at : at + n], v[:, :, at : at + n], mask[:, at : at + n], *state
            )
            outs.append(out)
            at += n
            assert state[0].shape[2] <= spec.chunk
        got = torch.cat(outs, 2)
        real = mask[1].nonzero().flatten()
        assert rel_diff(got[0], want[0]) < 1e-5 and rel_diff(got[1, :, real], want[1, :, real]) < 1e-5, pieces


def test_the_default_target_keeps_a_chunked_layer_exact(llama4):
    with pytest.warns(rnnify.errors.RnnifyWarning, match="layer 0 attends in chunks .*: kept exact"):
        model = rnnify.convert(llama4, to="window", window=4, sinks=1)
    assert [entry.target for entry in model.manifest.cells] == ["exact", "window"]
    assert model.constant_memory
    tokens = ids(3 * CHUNK)
    exact = rnnify.convert(llama4, to="exact", layers="1:window", window=4, sinks=1)
    assert rel_diff(decode(model, tokens, 5)[0], decode(exact, tokens, 5)[0]) < 1e-6


def test_a_rule_naming_another_target_for_a_chunked_layer_is_refused(llama4):
    with pytest.raises(RnnifyError, match=r"layer 0 .*attends in chunks of 8 tokens.*--to exact"):
        rnnify.convert(llama4, to="exact", layers="0:window", window=4)


def test_auto_keeps_chunked_layers_exact_and_chooses_among_the_others(llama4):
    scorer = HeadScorer(llama4, ids(64), score="kl", window=4, sinks=1, calib_len=64, calib_rows=2, passkey=0)
    assert scorer.exact_layers == {0} and {layer for layer, _ in scorer.heads} == {1}
    report = scorer.choose("100%", 1000)
    assert set(report.kinds) == {"1.0", "1.1"}  # the chunked layer's heads are not offered
    model = convert_chosen(llama4, report)
    assert [entry.target for entry in model.manifest.cells][0] == "exact"
    assert report.state_bytes == model.state_nbytes(1000)


def test_the_whole_llama4_converts_its_language_model_exactly(llama4):
    import transformers

    # Llama4ForConditionalGeneration: every released Llama 4 checkpoint
    vision = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
        patch_size=14, vision_output_dim=64, projector_input_dim=64, projector_output_dim=64,
    )  # fmt: skip
    config = transformers.Llama4Config(text_config=llama4.config.to_dict(), vision_config=vision)
    model = transformers.Llama4ForConditionalGeneration(config).eval()
    with pytest.warns(rnnify.errors.RnnifyWarning, match="composite model"):
        converted = rnnify.convert(model, to="exact")
    tokens = ids(2 * CHUNK + 4)
    assert rel_diff(decode(converted, tokens, CHUNK + 1)[0], original_logits(model, tokens)) < 1e-4
