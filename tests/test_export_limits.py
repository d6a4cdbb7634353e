"""Models whose forward slices a buffer of their position limit by the length (a causal-mask buffer
of ``max_positions`` rows, a table of positions) export only for lengths below that limit; capture
retries with it (rnnify/compiler/capture.py), and find_positions records the limit of the learned
positions they read. The captured graph must still compute the original's logits up to the limit."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from support import original_logits, rel_diff, tiny_causal_lm

import rnnify
from rnnify.compiler.capture import GRAPH_LIMIT, capture
from rnnify.compiler.passes import PassContext, run_pipeline
from rnnify.compiler.passes.find_positions import find_positions
from rnnify.compiler.passes.strip_export_checks import strip_export_checks
from rnnify.errors import PositionError, RnnifyError
from rnnify.runtime.hf_files import wrap_config

LIMIT = 32  # the models' position limit
DOGE = dict(  # Doge's keep_window_size at its declared positions
    vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, keep_window_size=LIMIT, max_position_embeddings=LIMIT,
)  # fmt: skip
MODELS = {
    "gpt_neo": lambda: transformers.GPTNeoForCausalLM(
        transformers.GPTNeoConfig(
            vocab_size=320,
            hidden_size=64,
            num_layers=2,
            num_heads=4,
            attention_types=[[["global", "local"], 1]],
            window_size=8,
            max_position_embeddings=LIMIT,
        )
    ),
    "openai-gpt": lambda: transformers.OpenAIGPTLMHeadModel(
        transformers.OpenAIGPTConfig(vocab_size=320, n_embd=64, n_layer=2, n_head=4, n_positions=LIMIT)
    ),
    "xglm": lambda: transformers.XGLMForCausalLM(  # a sinusoidal table read by index_select, from position + 2
        transformers.XGLMConfig(
            vocab_size=320, d_model=64, num_layers=2, attention_heads=4, ffn_dim=128, max_position_embeddings=LIMIT
        )
    ),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_a_model_that_exports_only_up_to_its_position_limit_is_captured(name, monkeypatch):
    torch.manual_seed(0)
    source = MODELS[name]().eval()
    export, attempts = torch.export.export, []

    def recorded(*args, dynamic_shapes=None, **kwargs):
        attempts.append(dynamic_shapes and getattr(dynamic_shapes[0][1], "max", None))
        return export(*args, dynamic_shapes=dynamic_shapes, **kwargs)

    monkeypatch.setattr(torch.export, "export", recorded)
    gm = capture(source)
    assert attempts[0] > LIMIT and attempts[1] < LIMIT  # it failed over any length, then was retried
    # a static trace one token past the table: only XGLM reads further (it rebuilds its sinusoid
    # table), so its graph is kept to the table, as its learned positions are
    assert attempts[2] is None and gm.meta.get(GRAPH_LIMIT) == (LIMIT if name == "xglm" else None)
    for length in (2, LIMIT - 1, LIMIT):
        ids = torch.randint(1, 320, (2, length), generator=torch.Generator().manual_seed(length))
        with torch.no_grad():
            want = source(input_ids=ids, use_cache=False).logits
            (got,) = gm(ids, torch.arange(length).expand(2, -1))
        assert rel_diff(got, want) < 1e-5
    ctx = PassContext(config=source.config)
    run_pipeline(gm, ctx, [strip_export_checks, find_positions])
    assert ctx.positions == {"kind": "learned", "limit": LIMIT}


def test_a_source_that_branches_on_the_length_past_its_table_converts_up_to_it_alone(tmp_path):
    """Doge keeps only its ``keep_window_size`` best keys once the keys outnumber them, a branch on
    the length; with as many declared positions, export holds up to them alone. The converted model
    is the original there and refuses to read further, where the original computes another way (the
    graph would read on, as if every key were kept)."""
    source = tiny_causal_lm("doge", **DOGE)
    model = rnnify.convert(source, to="exact")
    assert model.manifest.positions["graph_limit"] == LIMIT
    model.save(tmp_path / "doge")
    model = rnnify.load(tmp_path / "doge")
    ids = torch.randint(3, DOGE["vocab_size"], (1, LIMIT + 8), generator=torch.Generator().manual_seed(0))
    assert rel_diff(model.prefill(ids[:, :LIMIT])[0], original_logits(source, ids[:, :LIMIT])) < 1e-5
    with pytest.raises(PositionError, match=f"past the {LIMIT} positions its graph holds for"):
        model.prefill(ids)
    _, state = model.prefill(ids[:, :LIMIT])
    with pytest.raises(PositionError):
        model.step(ids[:, LIMIT : LIMIT + 1], state)
    with pytest.raises(RnnifyError, match=f"past the model's {LIMIT} positions its graph holds for"):
        rnnify.evaluate(model, ids, seq_len=LIMIT + 1)  # eval's rows are checked before anything runs
    del model.manifest.positions["graph_limit"]  # the graph past the limit: not the original
    assert rel_diff(model.prefill(ids)[0], original_logits(source, ids)) > 1e-2


class _BranchesOnValuesPastItsTable(transformers.LlamaForCausalLM):
    """A Llama that, past its declared length, doubles its logits where they sum above zero: control
    flow on the tensors' values, which no trace past the table can check."""

    def forward(self, input_ids=None, **kwargs):
        out = super().forward(input_ids=input_ids, **kwargs)
        if input_ids.shape[1] > self.config.max_position_embeddings and out.logits.sum() > 0:
            out.logits = out.logits * 2
        return out


def test_a_source_branching_on_values_past_its_table_is_kept_to_it():
    config = transformers.LlamaConfig(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=LIMIT,
    )  # fmt: skip
    torch.manual_seed(0)
    source = _BranchesOnValuesPastItsTable(config).eval()
    ids = torch.randint(3, 320, (1, LIMIT + 4), generator=torch.Generator().manual_seed(1))
    assert original_logits(source, ids).sum() > 0  # the branch is taken past the table
    model = rnnify.convert(source, to="exact")
    assert model.manifest.positions["graph_limit"] == LIMIT
    assert rel_diff(model.prefill(ids[:, :LIMIT])[0], original_logits(source, ids[:, :LIMIT])) < 1e-5
    with pytest.raises(PositionError, match=f"past the {LIMIT} positions its graph holds for"):
        model.prefill(ids)


def test_a_graph_limit_caps_the_longest_sequence_in_config_json():
    """transformers' generate, lm-eval and vLLM read the longest sequence from config.json."""
    wrapped = json.loads(wrap_config(b'{"max_position_embeddings": 64}', {"positions": {"graph_limit": 31}}))
    assert wrapped["max_position_embeddings"] == 31 and wrapped["source_config"]["max_position_embeddings"] == 64
    assert (
        json.loads(wrap_config(b'{"max_position_embeddings": 64}', {"positions": {}}))["max_position_embeddings"] == 64
    )
