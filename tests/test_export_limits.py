"""Models whose forward slices a buffer of their position limit by the length (a causal-mask buffer
of ``max_positions`` rows, a table of positions) export only for lengths below that limit; capture
retries with it (rnnify/compiler/capture.py), and find_positions records the limit of the learned
positions they read. The captured graph must still compute the original's logits up to the limit."""

from __future__ import annotations

import pytest
import torch
import transformers
from support import rel_diff

from rnnify.compiler.capture import capture
from rnnify.compiler.passes import PassContext, run_pipeline
from rnnify.compiler.passes.find_positions import find_positions
from rnnify.compiler.passes.strip_export_checks import strip_export_checks

LIMIT = 32  # the models' position limit
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

    def recorded(*args, dynamic_shapes, **kwargs):
        attempts.append(dynamic_shapes[0][1].max)
        return export(*args, dynamic_shapes=dynamic_shapes, **kwargs)

    monkeypatch.setattr(torch.export, "export", recorded)
    gm = capture(source)
    assert attempts[0] > LIMIT and attempts[-1] < LIMIT  # it failed over any length, then was retried
    for length in (2, LIMIT - 1, LIMIT):
        ids = torch.randint(1, 320, (2, length), generator=torch.Generator().manual_seed(length))
        with torch.no_grad():
            want = source(input_ids=ids, use_cache=False).logits
            (got,) = gm(ids, torch.arange(length).expand(2, -1))
        assert rel_diff(got, want) < 1e-5
    ctx = PassContext(config=source.config)
    run_pipeline(gm, ctx, [strip_export_checks, find_positions])
    assert ctx.positions == {"kind": "learned", "limit": LIMIT}
