"""LoRA on the attention projections of a converted model's graph, merged back into plain weights.

The step graph reads each projection weight through a ``get_attr`` of its Hugging Face state-dict
name (``model.layers.0.self_attn.q_proj.weight``), so a ``torch.nn.utils.parametrize``
parametrization on that attribute puts ``W + (alpha / r) B A`` into every forward without
touching the graph. The projections are the 2-D weights under each cell's attention module
(Llama/Mistral ``q_proj``/``k_proj``/``v_proj``/``o_proj``, GPT-2 ``c_attn``/``c_proj``), except
those whose output only feeds a q the cell ignores (Aaren's learned query replaces it): LoRA there
would never get a gradient, which DDP treats as an error. GPT-2's
``Conv1D`` stores ``[in, out]``; the graph shows it (the weight is the right operand of a
matrix product rather than ``linear``'s ``[out, in]``), and the update is transposed to match.
Merging bakes the update in, so a saved model holds plain weights and needs no LoRA code.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn.utils import parametrize

from rnnify.errors import RnnifyError, check_int
from rnnify.runtime.model import RecurrentModel

__all__ = ["LoRA", "add_lora", "lora_targets", "merge_lora"]

# Uses of a get_attr weight as the right operand of a matrix product: the weight is [in, out].
_RIGHT_OPERAND = {torch.ops.aten.addmm.default: 2, torch.ops.aten.mm.default: 1, torch.ops.aten.matmul.default: 1}


class LoRA(nn.Module):
    """Parametrization ``W -> W + (alpha / rank) * B A`` (transposed for ``[in, out]`` weights).

    A ``[rank, in]`` starts Kaiming-uniform and B ``[out, rank]`` at zero, so training starts from
    the unchanged model; both are fp32 whatever the weight's dtype, for the optimizer's sake.
    """

    def __init__(
        self,
        weight: torch.Tensor,
        rank: int,
        alpha: float,
        transposed: bool = False,
        generator: torch.Generator | None = None,
    ):
        super().__init__()
        out_features, in_features = weight.shape[::-1] if transposed else weight.shape
        self.transposed, self.scaling = transposed, alpha / rank
        # nn.Linear's init, as in the LoRA paper's code; drawn on the CPU from ``generator`` (default:
        # torch's global one), so A is the same whatever device the weight is on.
        a = nn.init.kaiming_uniform_(torch.empty(rank, in_features), a=math.sqrt(5), generator=generator)
        self.lora_a = nn.Parameter(a.to(weight.device))
        self.lora_b = nn.Parameter(torch.zeros(out_features, rank, device=weight.device, dtype=torch.float32))

    def delta(self) -> torch.Tensor:
        delta = (self.lora_b @ self.lora_a) * self.scaling
        return delta.T if self.transposed else delta

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight + self.delta().to(weight.dtype)


def lora_targets(model: RecurrentModel) -> dict[str, bool]:
    """``{weight name: transposed}`` for the 2-D weights under each cell's attention module that
    reach something the cell uses."""
    prefixes = tuple(entry.module_path + "." for entry in model.manifest.cells)
    unused = _ignored_query_only(model)
    targets: dict[str, bool] = {}
    for node in model.graph.graph.nodes:
        if (
            node.op != "get_attr"
            or not node.target.startswith(prefixes)
            or not node.target.endswith(".weight")
            or node in unused
        ):
            continue
        owner, _, leaf = node.target.rpartition(".")
        if getattr(model.graph.get_submodule(owner), leaf).dim() != 2:
            continue
        targets[node.target] = any(
            _RIGHT_OPERAND.get(user.target) is not None
            and len(user.args) > _RIGHT_OPERAND[user.target]
            and user.args[_RIGHT_OPERAND[user.target]] is node
            for user in node.users
        )
    return targets


def _ignored_query_only(model: RecurrentModel) -> set[torch.fx.Node]:
    """The graph's nodes whose values reach nothing but the q of cells that ignore it (``Cell.uses_query``)."""
    ignoring = {entry.module for entry, cell in zip(model.manifest.cells, model.cells) if not cell.uses_query}
    unused: set[torch.fx.Node] = set()
    if not ignoring:
        return unused

    def only_as_ignored_query(user: torch.fx.Node, node: torch.fx.Node) -> bool:
        rest = [*user.args[1:], *user.kwargs.values()]
        return (
            user.op == "call_module"
            and user.target in ignoring
            and user.args[0] is node
            and not any(arg is node for arg in rest)
        )

    for node in reversed(model.graph.graph.nodes):  # users before the nodes they read
        if node.users and all(user in unused or only_as_ignored_query(user, node) for user in node.users):
            unused.add(node)
    return unused


def unreached_weights(model: RecurrentModel) -> set[str]:
    """Names of the weights that reach nothing but the q of cells that ignore it: they never get a
    gradient, so training them is wasted (and DDP refuses parameters without one)."""
    return {node.target for node in _ignored_query_only(model) if node.op == "get_attr"}


def add_lora(
    model: RecurrentModel, rank: int, alpha: float, generator: torch.Generator | None = None
) -> dict[str, LoRA]:
    """Parametrize every attention projection of ``model`` (``lora_targets``) with a fresh ``LoRA``,
    its A drawn from ``generator``; returns them by weight name."""
    check_int("lora_rank", rank, error=RnnifyError)
    targets = lora_targets(model)
    if not targets:
        raise RnnifyError("found no attention projection weights to put LoRA on in this model's graph")
    loras = {}
    for name, transposed in targets.items():
        owner_name, _, leaf = name.rpartition(".")
        owner = model.graph.get_submodule(owner_name)
        lora = LoRA(getattr(owner, leaf), rank, alpha, transposed, generator)
        parametrize.register_parametrization(owner, leaf, lora)
        loras[name] = lora
    return loras


def merge_lora(model: RecurrentModel) -> None:
    """Bake every LoRA update into its weight and remove the parametrizations (plain weights again)."""
    for module in list(model.graph.modules()):
        if parametrize.is_parametrized(module):
            for leaf in list(module.parametrizations.keys()):
                with torch.no_grad():
                    parametrize.remove_parametrizations(module, leaf, leave_parametrized=True)
