"""Mixture-of-experts layers whose routing torch.export cannot trace, in a form it can.

transformers computes most expert layers through its experts interface (``grouped_mm`` and
``batched_mm``, which export captures). A few expert modules keep their own loop over the experts
that received a token, ``for expert in (mask.sum(...) > 0).nonzero()``: how often it runs depends
on the token values, and export fails on it (a guard on a data-dependent size). During capture,
``routing_forms`` gives each such module a forward that runs every expert on every token and
weights its output by the routing weight the token gave it, zero where the router did not pick it:
the same sum the loop computes, with the experts in the same order, and one graph for any input. It
costs what a dense layer of all the experts costs, where the loop ran only the experts picked.

transformers' experts interface multiplies each expert's tokens with torch's grouped matmul
(``aten._grouped_mm``) where it can, in bfloat16, and otherwise with its own fallback op
(``transformers.grouped_mm_fallback``). The grouped matmul takes the offsets it is given as
they come, to a kernel that reads and writes by them, and a shared graph.json may compute any
offsets; the fallback slices its tensors by them and so stays within them. The step graph's
vocabulary holds the fallback alone: ``routing_forms`` has the interface take it in every dtype
while the model is captured.
"""

from __future__ import annotations

import contextlib
import importlib
import types
from collections.abc import Callable, Iterator

import torch

__all__ = ["routing_forms"]


def _dbrx_experts(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
    """``DbrxExperts.forward`` (transformers' ``models/dbrx``) over all its experts."""
    tokens = hidden_states.reshape(-1, self.hidden_size)
    split = (self.num_experts, self.ffn_hidden_size, self.hidden_size)
    gate, up, down = (weight.view(split) for weight in (self.mlp.w1, self.mlp.v1, self.mlp.w2))
    out = torch.zeros_like(tokens)
    for expert in range(self.num_experts):
        weight = (top_k_weights * (top_k_index == expert)).sum(-1, keepdim=True)
        out = out + self.mlp(tokens, gate[expert], up[expert], down[expert]) * weight
    return out.view(hidden_states.shape[0], -1, self.hidden_size)


# expert module class name -> its forward over all experts, with the module's own signature
FORMS: dict[str, Callable[..., torch.Tensor]] = {"DbrxExperts": _dbrx_experts}


@contextlib.contextmanager
def _grouped_matmul_fallback() -> Iterator[None]:
    """Within the block, transformers' experts interface multiplies with its fallback op (module docstring)."""
    moe = importlib.import_module("transformers.integrations.moe")
    can_use = getattr(moe, "_can_use_grouped_mm", None)
    if can_use is None:  # a transformers without the choice
        yield
        return
    moe._can_use_grouped_mm = lambda *args, **kwargs: False
    try:
        yield
    finally:
        moe._can_use_grouped_mm = can_use


@contextlib.contextmanager
def routing_forms(model: torch.nn.Module) -> Iterator[None]:
    """Within the block, each expert module of ``model`` named in ``FORMS`` runs that form, and
    transformers' experts interface multiplies with its fallback op."""
    # a forward set on the instance (accelerate's hooks set one) is put back after
    patched = {module: module.__dict__.get("forward") for module in model.modules() if type(module).__name__ in FORMS}
    try:
        for module in patched:
            module.forward = types.MethodType(FORMS[type(module).__name__], module)
        with _grouped_matmul_fallback():
            yield
    finally:
        for module, own in patched.items():
            if own is None:
                del module.forward  # the class's forward again
            else:
                module.forward = own
