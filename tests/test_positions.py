"""Positions numbered as the source numbers them (rnnify/compiler/numbering.py, find_positions): RoBERTa's
family run as decoders counts from padding_idx + 1, and converts exactly; a numbering rnnify does not know is
refused before capture."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import transformers
from support import assert_steps_and_split_prefill_match, decode, decode_from, exact_conversions, rel_diff

import rnnify
from rnnify.cli import main
from rnnify.compiler.numbering import first_position
from rnnify.errors import PositionError, RnnifyWarning, UnsupportedModelError
from rnnify.runtime.agreement import tolerance

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from arch_configs import build  # noqa: E402

TABLE = 66  # rows of the position table: 64 positions after padding_idx + 1 = 2
FAMILIES = {
    "roberta": ("RobertaConfig", "RobertaForCausalLM"),
    "xlm-roberta": ("XLMRobertaConfig", "XLMRobertaForCausalLM"),
    "camembert": ("CamembertConfig", "CamembertForCausalLM"),
    "data2vec-text": ("Data2VecTextConfig", "Data2VecTextForCausalLM"),
}


def _decoder(family: str):
    config_class, model_class = (getattr(transformers, name) for name in FAMILIES[family])
    torch.manual_seed(0)
    config = config_class(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=TABLE,
        is_decoder=True,
    )
    return model_class(config).eval()


def _tokens(batch: int, length: int, seed: int, padding_id: int) -> torch.Tensor:
    """Random tokens other than the padding id (the original counts a padding id as no position)."""
    ids = torch.randint(0, 319, (batch, length), generator=torch.Generator().manual_seed(seed))
    return ids + (ids >= padding_id).long()


@pytest.fixture(scope="module")
def converted():
    return exact_conversions(_decoder)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_exact_equals_the_original_prefill_and_steps(family, converted):
    source, model = converted(family)
    padding_id = source.config.pad_token_id
    assert model.manifest.positions == {"kind": "learned", "limit": TABLE - padding_id - 1}
    ids = _tokens(2, 24, 1, padding_id)
    with torch.no_grad():
        want = source(input_ids=ids, use_cache=False).logits
    assert rel_diff(model.prefill(ids)[0], want) < 1e-4
    assert rel_diff(decode(model, ids, 8)[0], want) < 1e-4  # a prefill of 8, then 16 steps
    assert_steps_and_split_prefill_match(model, ids, split=11)


def test_left_padding_equals_the_original(converted):
    source, model = converted("roberta")
    padding_id = source.config.pad_token_id
    ids = _tokens(2, 12, 2, padding_id)
    mask = torch.ones_like(ids)
    ids[0, :5], mask[0, :5] = padding_id, 0
    with torch.no_grad():
        want = source(input_ids=ids, attention_mask=mask, use_cache=False).logits
    got, state = model.prefill(ids, attention_mask=mask)
    assert rel_diff(got[0, 5:], want[0, 5:]) < 1e-4 and rel_diff(got[1], want[1]) < 1e-4
    more = _tokens(2, 4, 3, padding_id)
    with torch.no_grad():
        whole = torch.cat([ids, more], 1), torch.cat([mask, torch.ones_like(more)], 1)
        want = source(input_ids=whole[0], attention_mask=whole[1], use_cache=False).logits
    stepped, _ = decode_from(model, more, state)
    assert rel_diff(stepped[0], want[0, 12:]) < 1e-4 and rel_diff(stepped[1], want[1, 12:]) < 1e-4


def test_the_whole_table_is_read_and_no_further(converted):
    source, model = converted("roberta")
    limit = model.manifest.positions["limit"]
    ids = _tokens(1, limit, 4, source.config.pad_token_id)
    with torch.no_grad():
        want = source(input_ids=ids, use_cache=False).logits
    logits, state = model.prefill(ids)
    assert rel_diff(logits, want) < 1e-4
    with pytest.raises(PositionError, match=f"past the {limit} learned positions"):
        model.step(ids[:, :1], state)


def test_generate_refuses_up_front_what_would_pass_the_table(converted, monkeypatch):
    source, model = converted("roberta")
    limit, padding_id = model.manifest.positions["limit"], source.config.pad_token_id
    ids = _tokens(1, 10, 5, padding_id)
    # the prompt's positions and every new token's but the last, which is never read back
    assert model.generate(ids, max_new_tokens=limit - 9).shape[1] == limit + 1
    read = []
    monkeypatch.setattr(model, "prefill", lambda *args, **kwargs: read.append(args))
    with pytest.raises(
        PositionError,
        match=f"need {limit + 1} positions, past the {limit} learned positions .*"
        f"ask for at most {limit - 9} new tokens",
    ):
        model.generate(ids, max_new_tokens=limit - 8)
    with pytest.raises(PositionError, match=f"the prompt is {limit + 1} tokens, past the {limit} learned positions"):
        model.generate(_tokens(1, limit + 1, 6, padding_id), max_new_tokens=0)
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[:, :4] = 0  # left padding takes no position: 8 real tokens a row
    with pytest.raises(PositionError, match=f"ask for at most {limit - 7} new tokens"):
        model.generate(_tokens(2, 12, 7, padding_id), attention_mask=mask, max_new_tokens=limit - 6)
    assert not read  # refused before the prompt was read


def test_transformers_generate_refuses_up_front_what_would_pass_the_table(converted, monkeypatch):
    from rnnify.integrations.transformers import RnnifyForCausalLM

    source, model = converted("roberta")
    limit, padding_id = model.manifest.positions["limit"], source.config.pad_token_id
    wrapper = RnnifyForCausalLM.from_rnnify(model)
    ids = _tokens(1, 10, 5, padding_id)
    assert wrapper.generate(ids, max_new_tokens=limit - 9, min_new_tokens=limit - 9).shape[1] == limit + 1
    read = []
    monkeypatch.setattr(wrapper, "forward", lambda *args, **kwargs: read.append(args))
    with pytest.raises(ValueError, match=f"need {limit + 1} positions, .*ask for at most {limit - 9} new tokens"):
        wrapper.generate(ids, max_new_tokens=limit - 8)
    with pytest.raises(ValueError, match=f"ask for at most {limit - 9} new tokens"):
        wrapper.generate(ids, max_length=limit + 2)  # max_length counts the prompt
    long = _tokens(1, limit - 5, 8, padding_id)
    assert wrapper.config.max_position_embeddings > limit  # the source's table: transformers' default reaches past
    with pytest.raises(ValueError, match="ask for at most 6 new tokens"):
        wrapper.generate(long)  # transformers' default: 20 new tokens, within max_position_embeddings
    assert not read  # refused before the prompt was read


def test_transformers_generate_counts_padding_it_finds_by_the_padding_id(converted):
    """Without a mask, transformers masks the padding id where it is not an end of sequence: the
    padding takes no positions, and the check counts none for it."""
    from rnnify.integrations.transformers import RnnifyForCausalLM

    source, model = converted("roberta")
    limit, padding_id = model.manifest.positions["limit"], source.config.pad_token_id
    wrapper = RnnifyForCausalLM.from_rnnify(model)
    assert wrapper.generation_config.pad_token_id == padding_id
    real = _tokens(1, 8, 9, padding_id)
    padded = torch.cat([torch.full((1, 4), padding_id), real], 1)
    got = wrapper.generate(padded, max_new_tokens=limit - 7, min_new_tokens=limit - 7)
    masked = wrapper.generate(
        padded, attention_mask=padded != padding_id, max_new_tokens=limit - 7, min_new_tokens=limit - 7
    )
    assert got.shape[1] == 12 + limit - 7 and torch.equal(got, masked)
    with pytest.raises(ValueError, match=f"ask for at most {limit - 7} new tokens"):
        wrapper.generate(padded, max_new_tokens=limit - 6)


def test_generate_command_refuses_before_printing_a_token(converted, tmp_path, capsys):
    _, model = converted("roberta")
    limit = model.manifest.positions["limit"]
    model.save(tmp_path / "model")
    code = main(["generate", str(tmp_path / "model"), "--ids", "5,6,7", "--max-new-tokens", str(limit)])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and f"ask for at most {limit - 2} new tokens" in err and err.count("\n") == 1


def test_save_and_load_give_the_same_logits(converted, tmp_path):
    source, model = converted("xlm-roberta")
    back = rnnify.load(model.save(tmp_path / "xlm-roberta"))
    ids = _tokens(2, 10, 5, source.config.pad_token_id)
    assert back.manifest.positions == model.manifest.positions
    assert torch.equal(decode(back, ids, 4)[0], decode(model, ids, 4)[0])


def test_convert_warns_that_a_row_holding_the_padding_id_differs():
    """The original gives a padding id read as a token position padding_idx and counts none for it;
    the conversion numbers it like any token (numbering.py), and says so when it converts."""
    source = _decoder("roberta")
    padding_id = source.config.pad_token_id
    with pytest.warns(RnnifyWarning, match=rf"RobertaForCausalLM sets its padding id {padding_id} apart"):
        model = rnnify.convert(source, to="exact")
    ids = _tokens(1, 10, 6, padding_id)
    ids[0, 4] = padding_id
    with torch.no_grad():
        want = source(input_ids=ids, use_cache=False).logits
    assert rel_diff(decode(model, ids, 6)[0], want) > tolerance(torch.float32)  # what the warning says


def test_a_model_reading_its_padding_id_as_a_token_converts_without_that_warning(tiny_model_dir, recwarn):
    source = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama")).eval()
    source.config.pad_token_id = 0  # its embedding reads it as any row; nothing else reads the tokens
    rnnify.convert(source, to="exact")
    assert not [w for w in recwarn if "padding id" in str(w.message)]


def test_where_positions_start(tiny_model_dir, converted):
    gpt2 = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir("gpt2")).eval()
    assert first_position(gpt2, gpt2.config.vocab_size) == 0
    roberta, _ = converted("roberta")
    assert first_position(roberta, roberta.config.vocab_size) == roberta.config.pad_token_id + 1 == 2


def test_a_table_read_from_an_offset_holds_that_many_positions_fewer():
    """OPT adds 2 to its positions before its table of max_position_embeddings + 2 rows."""
    torch.manual_seed(0)
    config = transformers.OPTConfig(
        vocab_size=320,
        hidden_size=64,
        ffn_dim=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
    )
    source = transformers.OPTForCausalLM(config).eval()
    model = rnnify.convert(source, to="exact")
    assert model.manifest.positions == {"kind": "learned", "limit": 64}
    ids = _tokens(1, 64, 7, config.pad_token_id)
    with torch.no_grad():
        want = source(input_ids=ids, use_cache=False).logits
    logits, state = model.prefill(ids)
    assert rel_diff(logits, want) < 1e-4
    with pytest.raises(PositionError, match="past the 64 learned positions"):
        model.step(ids[:, :1], state)


class _CountsFromThree(transformers.GPT2LMHeadModel):
    """GPT-2 that numbers its own positions from 3: a numbering rnnify does not know."""

    def forward(self, input_ids=None, position_ids=None, **kwargs):
        if position_ids is None:
            position_ids = torch.arange(3, 3 + input_ids.shape[1])[None]
        return super().forward(input_ids=input_ids, position_ids=position_ids, **kwargs)


def test_an_unknown_numbering_is_refused_before_capture(tiny_model_dir, monkeypatch):
    source = _CountsFromThree.from_pretrained(tiny_model_dir("gpt2")).eval()
    exported = []
    monkeypatch.setattr(torch.export, "export", lambda *a, **k: exported.append(a))
    with pytest.raises(UnsupportedModelError, match="numbers its positions in a way rnnify does not know"):
        rnnify.convert(source, to="linear")
    assert not exported


def test_a_source_that_fails_on_its_own_is_refused_in_one_line(tiny_model_dir, monkeypatch):
    source = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama")).eval()

    def fails(*args, **kwargs):
        raise RuntimeError("expected m1 and m2 to have the same dtype\nmore lines")

    monkeypatch.setattr(source.lm_head, "forward", fails)
    with pytest.raises(
        UnsupportedModelError,
        match=r"LlamaForCausalLM fails when run on token ids, in float32 with its sdpa.*same dtype",
    ) as e:
        rnnify.convert(source, to="exact")
    assert "\n" not in str(e.value)


def test_a_model_that_needs_more_than_token_ids_is_refused_before_capture():
    """IDEFICS (1) is a causal LM in transformers' eyes but needs its images: refused in one line."""
    model, _ = build("idefics")
    with pytest.raises(
        UnsupportedModelError,
        match=r"IdeficsForVisionText2Text fails when run on token ids alone \(ValueError: Exactly",
    ):
        rnnify.convert(model, to="exact")


# BART's family numbers the tokens it is given itself (find_positions gives it the runtime's positions)
BART_FAMILY = {
    "bart": ("BartConfig", "BartForCausalLM"),  # learned table, read at position + 2
    "mbart": ("MBartConfig", "MBartForCausalLM"),
    "plbart": ("PLBartConfig", "PLBartForCausalLM"),
    "mvp": ("MvpConfig", "MvpForCausalLM"),  # counted by arange(cache_length, cache_length + T)
    "trocr": ("TrOCRConfig", "TrOCRForCausalLM"),
    "blenderbot": ("BlenderbotConfig", "BlenderbotForCausalLM"),  # learned table, from 0
    "blenderbot-small": ("BlenderbotSmallConfig", "BlenderbotSmallForCausalLM"),
    "marian": ("MarianConfig", "MarianForCausalLM"),  # sinusoidal table
    "pegasus": ("PegasusConfig", "PegasusForCausalLM"),
    "musicgen": ("MusicgenDecoderConfig", "MusicgenForCausalLM"),  # sinusoidal table read by index_select
}
BART_POSITIONS = 40
_ENCODER_DECODER_SIZES = {
    f"{part}_{key}": value
    for part in ("encoder", "decoder")
    for key, value in dict(layers=2, attention_heads=4, ffn_dim=128).items()
}
_SIZES = {
    "musicgen": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, ffn_dim=128, num_codebooks=1),
}


def _bart_decoder(family: str):
    config_class, model_class = (getattr(transformers, name) for name in BART_FAMILY[family])
    torch.manual_seed(0)
    sizes = _SIZES.get(family, dict(d_model=64, **_ENCODER_DECODER_SIZES))
    config = config_class(
        vocab_size=320,
        max_position_embeddings=BART_POSITIONS,
        pad_token_id=0,
        bos_token_id=0,
        decoder_start_token_id=0,
        **sizes,
    )
    return model_class(config).eval()


def _words(batch: int, length: int, seed: int) -> torch.Tensor:
    """Random tokens, none of them a padding id."""
    return torch.randint(2, 320, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def bart_converted():
    return exact_conversions(_bart_decoder)


@pytest.mark.parametrize("family", list(BART_FAMILY))
def test_a_decoder_that_counts_its_tokens_itself_steps_as_the_original(family, bart_converted):
    source, model = bart_converted(family)
    ids = _words(2, 24, 11)
    with torch.no_grad():
        want = source(input_ids=ids, use_cache=False).logits
    assert rel_diff(model.prefill(ids)[0], want) < 1e-4
    assert rel_diff(decode(model, ids, 8)[0], want) < 1e-4  # a prefill of 8, then 16 steps
    assert model.manifest.positions == {"kind": "learned", "limit": BART_POSITIONS}


@pytest.mark.parametrize("family", ["bart", "pegasus", "musicgen"])
def test_left_padded_rows_of_a_counting_decoder_equal_the_original_on_each_row_alone(family, bart_converted):
    source, model = bart_converted(family)
    rows = [_words(1, 9, 12)[0], _words(1, 4, 13)[0]]
    ids, mask = torch.zeros(2, 9, dtype=torch.long), torch.zeros(2, 9, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, 9 - len(row) :], mask[i, 9 - len(row) :] = row, 1
    more = _words(2, 5, 14)
    logits, state = model.prefill(ids, attention_mask=mask)
    stepped, _ = decode_from(model, more, state)
    for i, row in enumerate(rows):
        with torch.no_grad():
            alone = source(input_ids=torch.cat([row, more[i]])[None], use_cache=False).logits[0]
        assert rel_diff(logits[i, 9 - len(row) :], alone[: len(row)]) < 1e-4
        assert rel_diff(stepped[i], alone[len(row) :]) < 1e-4


@pytest.mark.parametrize("family", ["bart", "pegasus", "musicgen"])
def test_a_counting_decoder_reads_its_whole_table_and_no_further(family, bart_converted):
    source, model = bart_converted(family)
    ids = _words(1, BART_POSITIONS, 15)
    with torch.no_grad():
        want = source(input_ids=ids, use_cache=False).logits
    logits, state = decode(model, ids, BART_POSITIONS - 3)
    assert rel_diff(logits, want) < 1e-4
    with pytest.raises(PositionError, match=f"past the {BART_POSITIONS} learned positions"):
        model.step(ids[:, :1], state)


def test_a_counting_decoder_saved_and_loaded_gives_the_same_logits(bart_converted, tmp_path):
    _, model = bart_converted("mbart")
    back = rnnify.load(model.save(tmp_path / "mbart"))
    ids = _words(2, 10, 16)
    assert back.manifest.positions == model.manifest.positions
    assert torch.equal(decode(back, ids, 4)[0], decode(model, ids, 4)[0])


def _llama4(attention_chunk_size: int | None):
    """Llama 4 text model: layer 0 with RoPE, layer 1 without, whose queries Llama 4 scales by
    1 + attn_scale * log1p(floor((position + 1) / floor_scale)) (a floor_scale small enough to change
    within a few tokens)."""
    torch.manual_seed(0)
    config = transformers.Llama4TextConfig(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        intermediate_size_mlp=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=2,
        no_rope_layers=[1, 0],
        attention_chunk_size=attention_chunk_size,
        attn_temperature_tuning=True,
        floor_scale=4,
        attn_scale=0.5,
    )
    return transformers.Llama4ForCausalLM(config).eval()


@pytest.mark.parametrize("chunk", [None, 8])  # 8: layer 0 attends in chunks, which rows cross below
def test_llama4_query_temperature_follows_the_runtimes_positions(chunk):
    source = _llama4(attention_chunk_size=chunk)
    model = rnnify.convert(source, to="exact")
    ids = _words(2, 24, 17)
    with torch.no_grad():
        want = source(input_ids=ids, use_cache=False).logits
    assert rel_diff(model.prefill(ids)[0], want) < 1e-4
    assert rel_diff(decode(model, ids, 8)[0], want) < 1e-4
    row, more = _words(1, 6, 18), _words(2, 4, 19)
    ids = torch.cat([_words(1, 9, 20), torch.cat([torch.zeros(1, 3, dtype=torch.long), row], 1)])
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    logits, state = model.prefill(ids, attention_mask=mask)
    stepped, _ = decode_from(model, more, state)
    with torch.no_grad():
        alone = source(input_ids=torch.cat([row, more[1:]], 1), use_cache=False).logits[0]
    assert rel_diff(torch.cat([logits[1, 3:], stepped[1]]), alone) < 1e-4
