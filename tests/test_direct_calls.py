"""Eager inference runs the step graph with direct torch calls (``rnnify.runtime.direct_calls``):
the same numbers as the graph module itself, live weights, and a fresh forward after a recompile."""

from __future__ import annotations

import pytest
import torch

import rnnify
from rnnify.distillation.lora import add_lora
from rnnify.runtime.direct_calls import DIRECT, direct_forward


def graph_inputs(model, length: int = 7):
    ids = torch.randint(0, model.manifest.vocab_size, (2, length), generator=torch.Generator().manual_seed(0))
    state = model.init_state(2)
    positions = torch.arange(length)[None].expand(2, -1)
    return ids, positions, torch.ones(2, length, dtype=torch.bool), *state.tensors


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("target", ["exact", "hybrid"])
def test_direct_forward_equals_the_graph_module(converted_dir, arch, target):
    model = rnnify.load(converted_dir(arch, target))
    graph = model.graph
    aten_ops = [n for n in graph.graph.nodes if n.op == "call_function" and n.target in DIRECT]
    assert len(aten_ops) > 20  # the table matches what export writes: this test checks something
    args = graph_inputs(model)
    with torch.no_grad():
        want = graph(*args)
        got = direct_forward(graph)(graph, *args)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert all(n.target not in DIRECT.values() for n in graph.graph.nodes)  # the stored graph keeps aten ops


def test_inference_sees_lora_weights_and_a_recompiled_graph(converted_dir):
    model = rnnify.load(converted_dir("llama", "linear"))
    ids = graph_inputs(model)[0]
    before, _ = model.prefill(ids)
    loras = add_lora(model, rank=2, alpha=4.0, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for lora in loras.values():
            lora.lora_b.normal_()
    with_lora, _ = model.prefill(ids)
    with torch.no_grad():
        reference = model.graph(*graph_inputs(model))[0]
    assert not torch.allclose(with_lora, before)
    assert torch.equal(with_lora, reference)

    output = next(n for n in model.graph.graph.nodes if n.op == "output")
    logits = output.args[0][0]
    with model.graph.graph.inserting_before(output):
        doubled = model.graph.graph.call_function(torch.ops.aten.mul.Tensor, (logits, 2.0))
    output.args = ((doubled, *output.args[0][1:]),)
    model.graph.recompile()
    doubled_logits, _ = model.prefill(ids)
    assert torch.equal(doubled_logits, 2 * with_lora)
