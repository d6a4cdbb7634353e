"""FSDP for distillation: each decoder layer's weights sharded over the ranks, gathered one layer at a time.

A converted model is one flat fx graph, and FSDP on it whole would gather every weight for
every step (peak memory no better than DDP's). So for each stage the trainer builds a training
copy: the step graph split into ``prologue``, ``layer_<i>`` and ``epilogue`` pieces
(``rnnify.distillation.split_layers``), each piece holding new parameter objects that alias the
model's storage (copies of the cells and of the LoRA-parametrized projections likewise). Each
piece that shares no weight with another is sharded with FSDP2's ``fully_shard`` (one unit per
decoder layer), then the root, which keeps what is left: the pieces that share a weight (tied
input/output embeddings put both the prologue and the epilogue there). Each rank then holds
about 1/N of every unit's weights, and only one layer's full weights are gathered at a time in
forward (in backward FSDP prefetches the next layer's, so up to two), besides the root's.

Each cell with parameters is a unit of its own, inside its layer's. FSDP gathers a unit's
weights for backward when a gradient reaches the unit's outputs; attention transfer's losses
reach a cell's parameters from a hook on the cell's output, never through the layer's outputs
(teacher forcing cuts that path), so the cell must be the unit whose outputs they reach. It
also keeps a layer's trainable parameters in one dtype (FSDP reduces a unit's gradients in one):
the cells' are the model's, LoRA's fp32.

The copy's device constants (export's ``to(device=cpu)`` of the rotary table) point at the
mesh's device, so the model can stay on the CPU while its shards train on GPUs.

The model itself is never sharded: its parameters keep their objects and devices, and
``copy_back`` writes the trained values into them (gathered from the shards) at the end of each
stage, so LoRA merging and ``save`` work on the model as usual. Checkpoints hold full tensors,
gathered the same way, in the same format as without FSDP: a run may resume with or without
FSDP and on any number of ranks.

The teacher of the KL term is as large as the model, so it is sharded too, in place: each of its
decoder layers (plain modules of the Hugging Face model, at the paths the cell entries name) a
unit, then the whole.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from rnnify.distillation.split_layers import layer_prefix, split_layers
from rnnify.errors import RnnifyError
from rnnify.runtime.devices import retarget_devices
from rnnify.runtime.model import RecurrentModel

__all__ = [
    "ShardedModel",
    "device_mesh",
    "full_tensor",
    "full_optimizer_state",
    "shard_optimizer_state",
    "shard_teacher",
]


def device_mesh(device: torch.device):
    """The 1-D mesh of all ranks on ``device``'s type (gloo on CPU, NCCL on CUDA)."""
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        raise RnnifyError("FSDP needs a process group: run under torchrun with several processes")
    return init_device_mesh(device.type, (dist.get_world_size(),))


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor (an all-gather, which every rank must join, for a sharded one), detached."""
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        return tensor.full_tensor().detach()
    return tensor.detach()


class _SplitView(RecurrentModel):
    """``model`` running its split graph (``graph``): same manifest and state, the copies' cells."""

    def __init__(self, graph: torch.fx.GraphModule, model: RecurrentModel, cells: list[nn.Module]):
        super().__init__(graph, model.manifest)
        self._cells = cells

    @property
    def cells(self):
        return list(self._cells)

    def forward(self, *args, **kwargs):
        # FSDP warns that a unit returns views, which an in-place op downstream would detach from
        # its backward hook. The pieces are functional aten graphs (export's): nothing writes in place.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
            return super().forward(*args, **kwargs)

    def _direct_forward(self) -> Any:
        # Direct calls run the graph's code without its module hooks; FSDP's root gathers the
        # rooted pieces' weights (a tied embedding) in its pre-forward hook, so no_grad calls too go through it.
        return nn.Module.__call__


class ShardedModel:
    """The FSDP training copy of ``model`` (see the module docstring).

    ``view`` is a ``RecurrentModel`` to call and to build states and attention hooks with;
    ``param(p)`` is the (sharded) parameter standing for ``model``'s parameter ``p``. Parameters
    must have their final ``requires_grad`` before this is built (FSDP reads it on the first
    forward). ``units`` are the pieces sharded on their own (the cells always are), ``rooted``
    the pieces left to the root unit because they share a weight with another.
    """

    def __init__(self, model: RecurrentModel, mesh):
        from torch.distributed.fsdp import fully_shard

        self.memo: dict[int, Any] = {}
        graph = split_layers(model.graph, model.manifest.cells, memo=self.memo)
        retarget_devices(graph, mesh.device_type)  # the model may sit on the CPU, its shards run on the mesh's device
        for param in graph.parameters():  # FSDP shards only contiguous tensors, not a head laid out column-major
            if not param.is_contiguous():  # (runtime.weight_layout); the model's own weights keep their layout
                param.data = param.data.contiguous()
        self.view = _SplitView(graph, model, [self.memo[id(cell)] for cell in model.cells])
        self._where: dict[int, tuple[nn.Module, str]] = {}  # copy's id -> a module holding it, and its name
        for module in graph.modules():
            for name, param in module._parameters.items():
                if param is not None:
                    self._where.setdefault(id(param), (module, name))
        pieces = dict(graph.named_children())
        holders: dict[int, set[str]] = {}
        for name, piece in pieces.items():
            for param in piece.parameters():
                holders.setdefault(id(param), set()).add(name)
        self.units = [
            name
            for name, piece in pieces.items()
            if any(True for _ in piece.parameters()) and all(len(holders[id(p)]) == 1 for p in piece.parameters())
        ]
        self.rooted = [
            name for name, piece in pieces.items() if name not in self.units and any(True for _ in piece.parameters())
        ]
        for cell in self.view.cells:
            if any(True for _ in cell.parameters()):
                fully_shard(cell, mesh=mesh, reshard_after_forward=True)
        for name in self.units:
            fully_shard(pieces[name], mesh=mesh, reshard_after_forward=True)
        fully_shard(graph, mesh=mesh)

    def param(self, original: nn.Parameter) -> nn.Parameter:
        """The parameter of the training copy that stands for ``original`` (a DTensor shard once sharded)."""
        copy = self.memo.get(id(original))
        if copy is None or id(copy) not in self._where:
            raise RnnifyError("a trained parameter is not read by the step graph; FSDP cannot shard it")
        module, name = self._where[id(copy)]
        return module._parameters[name]

    def full(self, original: nn.Parameter) -> torch.Tensor:
        """The trained value of ``original``, whole, on the CPU (every rank must call this, in the same order)."""
        return full_tensor(self.param(original)).cpu()

    @torch.no_grad()
    def copy_back(self, originals: Sequence[nn.Parameter]) -> None:
        """Write the trained values into the model's own ``originals`` (in place: same objects, same devices)."""
        for original in originals:
            original.copy_(self.full(original).to(original.device))


def shard_teacher(teacher: nn.Module, model: RecurrentModel, mesh) -> list[str]:
    """Shard ``teacher`` (a Hugging Face model) per decoder layer, then whole; the layers sharded on their own."""
    from torch.distributed.fsdp import fully_shard

    layers = []
    for entry in model.manifest.cells:
        prefix = layer_prefix(entry.module_path, entry.layer)
        if prefix is None:
            continue
        try:
            layer = teacher.get_submodule(prefix[:-1])
        except AttributeError:
            continue
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
        layers.append(prefix[:-1])
    fully_shard(teacher, mesh=mesh, reshard_after_forward=True)
    return layers


def full_optimizer_state(state: dict[str, Any]) -> dict[str, Any]:
    """``optimizer.state_dict()`` with every sharded tensor gathered whole onto the CPU (all ranks must call this)."""
    gathered = {}
    for index in sorted(state["state"]):
        gathered[index] = {
            key: (full_tensor(value).cpu() if isinstance(value, torch.Tensor) else value)
            for key, value in sorted(state["state"][index].items())
        }
    return {"state": gathered, "param_groups": state["param_groups"]}


def shard_optimizer_state(state: dict[str, Any], params: Sequence[torch.Tensor]) -> dict[str, Any]:
    """A full optimizer state (``full_optimizer_state``, or a run's without FSDP) sharded like ``params``."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    sharded = {}
    for index, entry in state["state"].items():
        param = params[index]
        sharded[index] = {}
        for key, value in entry.items():
            if (
                isinstance(param, DTensor)
                and isinstance(value, torch.Tensor)
                and key != "step"
                and tuple(value.shape) == tuple(param.shape)
            ):
                value = distribute_tensor(value.to(param.to_local().device), param.device_mesh, param.placements)
            sharded[index][key] = value
    return {"state": sharded, "param_groups": state["param_groups"]}
