"""The step graph cut at its language-model head (``rnnify.runtime.head``): ``prefill(last_only=True)``
and ``prefill_hidden`` + ``head`` against the whole graph's logits, on tied and untied heads and
Gemma 2's final softcap; graphs whose head has another shape are left whole, and still answer."""

from __future__ import annotations

import pytest
import torch
import torch.fx
from test_biases import source_dir  # noqa: F401 - a fixture

import rnnify
from rnnify.runtime import model as runtime_model
from rnnify.runtime.head import split_head

aten = torch.ops.aten
CASES = [("llama", "window"), ("llama", "exact"), ("gpt2", "linear"), ("gemma2", "window")]


@pytest.fixture(scope="module")
def converted(tiny_model_dir, source_dir):  # noqa: F811 - the fixture imported above
    done = {}

    def get(arch: str, target: str):
        if (arch, target) not in done:
            path = source_dir(arch) if arch == "gemma2" else tiny_model_dir(arch)
            options = {"window": 4} if target == "window" else {}
            done[arch, target] = rnnify.convert(path, to=target, **options)
        return done[arch, target]

    return get


def _batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two rows of 12 tokens, the second left-padded by 4."""
    ids = torch.randint(1, vocab, (2, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[1, :4] = False
    return ids, mask


@pytest.mark.parametrize(("arch", "target"), CASES)
def test_last_only_prefill_equals_the_last_position_of_the_whole_one(converted, arch, target):
    model = converted(arch, target)
    assert split_head(model.graph.graph) is not None
    ids, mask = _batch(model.manifest.vocab_size)
    logits, state = model.prefill(ids, attention_mask=mask)
    last, last_state = model.prefill(ids, attention_mask=mask, last_only=True)
    assert last.shape == (2, 1, model.manifest.vocab_size)
    torch.testing.assert_close(last, logits[:, -1:])  # the head's matmul on one row per sequence
    assert all(torch.equal(a, b) for a, b in zip(last_state.tensors, state.tensors))
    assert torch.equal(last_state.positions, state.positions)
    one = ids[:, -1:]  # a one-token prompt goes the step's own way, with the whole head
    assert torch.equal(model.prefill(one, state, last_only=True)[0], model.prefill(one, state)[0])


@pytest.mark.parametrize(("arch", "target"), CASES)
def test_hidden_states_through_the_head_are_the_logits(converted, arch, target):
    model = converted(arch, target)
    ids, mask = _batch(model.manifest.vocab_size)
    logits, state = model.prefill(ids, attention_mask=mask)
    hidden, hidden_state = model.prefill_hidden(ids, model.init_state(2), attention_mask=mask)
    assert hidden.shape == (2, 12, model.hidden_size) and model.hidden_size < model.manifest.vocab_size
    assert torch.equal(model.head(hidden), logits)
    assert all(torch.equal(a, b) for a, b in zip(hidden_state.tensors, state.tensors))
    some = hidden.reshape(-1, model.hidden_size)[[3, 17, 5]]  # any rows, in any order
    torch.testing.assert_close(model.head(some), logits.reshape(-1, logits.shape[-1])[[3, 17, 5]])


def test_a_head_that_is_not_recognised_leaves_the_graph_whole(tiny_model_dir, monkeypatch):
    """Without a split the hidden states are the logits and the head returns them as they are."""
    monkeypatch.setattr(runtime_model, "split_head", lambda graph: None)
    model = rnnify.convert(tiny_model_dir("llama"), to="window", window=4)
    ids, mask = _batch(model.manifest.vocab_size)
    logits, _ = model.prefill(ids, attention_mask=mask)
    assert model.hidden_size == model.manifest.vocab_size
    hidden, _ = model.prefill_hidden(ids, model.init_state(2), attention_mask=mask)
    assert torch.equal(model.head(hidden), logits)
    torch.testing.assert_close(model.prefill(ids, attention_mask=mask, last_only=True)[0], logits[:, -1:])


def _graph(after_head, also=lambda head, x: x) -> torch.fx.GraphModule:
    """``x -> (after_head(linear(x, weight)), also(head, x))`` as an aten graph with a stored weight."""
    root = torch.nn.Module()
    root.weight = torch.nn.Parameter(torch.randn(7, 4, dtype=torch.float64))
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    head = graph.call_function(aten.linear.default, (x, graph.get_attr("weight")))
    graph.output((after_head(graph, head), also(head, x)))
    return torch.fx.GraphModule(root, graph)


def test_a_softcapped_head_is_split_and_a_mixing_one_is_not():
    def softcap(graph, node):
        node = graph.call_function(aten.div.Tensor, (node, 30.0))
        node = graph.call_function(aten.tanh.default, (node,))
        return graph.call_function(aten.mul.Tensor, (node, 30.0))

    gm = _graph(softcap)
    body, head = split_head(gm.graph)
    x = torch.randn(2, 3, 4, dtype=torch.float64)
    hidden, passed = torch.fx.GraphModule(gm, body)(x)
    assert torch.equal(hidden, x) and torch.equal(passed, x)
    torch.testing.assert_close(torch.fx.GraphModule(gm, head)(x), gm(x)[0], rtol=0, atol=1e-12)

    # a cumulative sum over positions mixes them: the last position's logits need every position's
    assert split_head(_graph(lambda graph, node: graph.call_function(aten.cumsum.default, (node, 1))).graph) is None
    # the head's output also returned as another output: the body would still need the head
    assert split_head(_graph(softcap, also=lambda head, x: head).graph) is None
