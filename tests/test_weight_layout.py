"""Linear weights are laid out for their device and dtype (``runtime.weight_layout``): float32 on a
CPU column-major, anything else row-major; values, ties and saved bytes unchanged."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

import rnnify
from rnnify.runtime.aot import fingerprint
from rnnify.runtime.weight_layout import TALL, lay_out_linear_weights, linear_weight_names


def _linear_weights(model: rnnify.RecurrentModel) -> dict[str, torch.Tensor]:
    return {name: model.graph.get_parameter(name) for name in linear_weight_names(model.graph)}


def _column_major(tensor: torch.Tensor) -> bool:
    return tensor.stride()[0] == 1 and tensor.stride()[1] >= tensor.shape[0]


def test_loaded_float32_heads_are_column_major_and_the_rest_row_major(converted_dir):
    for arch in ("llama", "gpt2"):
        weights = _linear_weights(rnnify.load(converted_dir(arch, "linear")))
        heads = {name for name, w in weights.items() if w.shape[0] >= TALL * w.shape[1]}
        assert heads == {"lm_head.weight"}, arch
        assert all(
            _column_major(w) == (name in heads) and w.is_contiguous() == (name not in heads)
            for name, w in weights.items()
        ), arch


class _Tied(torch.nn.Module):
    """A head and an embedding that are two parameters on one tensor, as ``rnnify.load`` restores
    a tied pair saved once."""

    def __init__(self):
        super().__init__()
        table = torch.randn(40, 4)  # a head: 10x taller than wide
        self.head, self.embed = torch.nn.Parameter(table), torch.nn.Parameter(table)

    def forward(self, ids):
        return torch.ops.aten.linear.default(torch.ops.aten.embedding.default(self.embed, ids), self.head)


def test_tied_weights_stay_one_tensor():
    graph = torch.fx.symbolic_trace(_Tied())
    ids = torch.tensor([[1, 5, 37]])
    expected = graph(ids)
    assert lay_out_linear_weights(graph) == 1
    assert _column_major(graph.head) and graph.embed.data_ptr() == graph.head.data_ptr()
    torch.testing.assert_close(graph(ids), expected)
    assert lay_out_linear_weights(graph) == 0  # already laid out


def test_layout_follows_dtype_and_leaves_the_outputs(converted_dir, tiny_model_dir, tmp_path):
    model = rnnify.load(converted_dir("llama", "exact"))
    ids = torch.randint(0, 100, (2, 9))
    logits, _ = model.prefill(ids)
    original = AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama")).eval()
    with torch.no_grad():
        torch.testing.assert_close(logits, original(ids).logits, rtol=1e-5, atol=1e-5)
    assert _column_major(_linear_weights(model)["lm_head.weight"])
    rnnify.convert(tiny_model_dir("llama"), to="exact", dtype="bfloat16").save(tmp_path / "bf16")
    half = rnnify.load(tmp_path / "bf16")  # a model runs in the dtype it was converted in
    assert all(w.is_contiguous() and w.dtype == torch.bfloat16 for w in _linear_weights(half).values())
    torch.testing.assert_close(half.prefill(ids)[0].float(), logits, rtol=0.05, atol=0.05)


def test_a_step_package_is_keyed_to_the_weights_layout(converted_dir):
    model = rnnify.load(converted_dir("llama", "linear"), aot_step=False)
    before = fingerprint(model)
    for weight in _linear_weights(model).values():
        weight.data = weight.data.contiguous()
    assert fingerprint(model) != before
