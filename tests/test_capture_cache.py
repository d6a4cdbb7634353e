"""The suite's capture cache (tests/capture_cache.py) hands a model the graph a fresh capture would:
bound to that model's own tensors, and only for a model equal in everything a capture reads."""

import torch

from tests import capture_cache
from tests.support import original_logits, tiny_causal_lm

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)


def _model(**changes):
    return tiny_causal_lm("llama", **{**SMALL, **changes})


def _logits(graph, model):
    ids = torch.arange(3, 11)[None]
    with torch.no_grad():
        (logits,) = graph(ids, torch.arange(ids.shape[1])[None])
        return logits, original_logits(model, ids)


def test_an_equal_model_gets_the_graph_bound_to_its_own_tensors():
    first, second = _model(), _model()
    capture_cache.capture(first)
    graph = capture_cache.capture(second)
    assert graph.get_parameter("lm_head.weight") is second.lm_head.weight
    got, want = _logits(graph, second)
    torch.testing.assert_close(got, want)
    with torch.no_grad():
        second.lm_head.weight.mul_(2)  # in place: a fresh capture's graph would follow too
    got, want = _logits(graph, second)
    torch.testing.assert_close(got, want)


def test_a_model_that_differs_in_what_export_reads_is_captured_afresh():
    base = _model()
    capture_cache.capture(base)
    key = capture_cache._key(base)
    weights, attribute, config, untied = _model(), _model(), _model(rms_norm_eps=1e-3), _model(tie_word_embeddings=True)
    with torch.no_grad():
        weights.model.norm.weight.add_(1)
    attribute.model.layers[0].self_attn.is_causal = False
    untied.lm_head.weight = torch.nn.Parameter(untied.lm_head.weight.detach().clone())  # equal, no longer shared
    method, hooked = _model(), _model()
    method.model.norm.forward = lambda hidden: hidden
    hooked.model.norm.register_forward_hook(lambda module, inputs, output: 2 * output)
    assert capture_cache._key(_model()) == key
    assert capture_cache._key(method) is None and capture_cache._key(hooked) is None
    tied = _model(tie_word_embeddings=True)
    keys = {capture_cache._key(m) for m in (weights, attribute, config, tied, untied)}
    assert len(keys | {key}) == 6
