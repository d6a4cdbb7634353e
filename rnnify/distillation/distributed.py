"""Data parallelism for distillation: the same code on one process or under ``torchrun``.

Under ``torchrun`` (``WORLD_SIZE`` > 1) the process group is started here (NCCL on CUDA, gloo on
CPU) unless the caller already did, each rank runs its slice of every global batch, and DDP
averages the gradients. Losses are sums divided by the global batch's token count times the
world size, so DDP's average equals the single-process mean exactly. With ``fsdp=True`` the
trainer shards a per-layer copy of the model instead of wrapping it in DDP (``fsdp``); FSDP
averages gradients the same way.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

__all__ = ["Runtime", "setup"]


@dataclass
class Runtime:
    rank: int
    world_size: int
    device: torch.device
    owns_group: bool  # we started the process group, so we end it

    @property
    def main(self) -> bool:
        """Rank 0: the one process that logs and writes."""
        return self.rank == 0

    def wrap(self, model: nn.Module) -> nn.Module:
        """``model`` under DDP when there are several ranks (call again after changing requires_grad)."""
        if self.world_size == 1:
            return model
        return DistributedDataParallel(model)

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum of ``tensor`` over ranks (a new tensor; ``tensor`` itself as is on one rank)."""
        if self.world_size == 1:
            return tensor
        total = tensor.detach().clone()
        dist.all_reduce(total)
        return total

    def close(self) -> None:
        if self.owns_group:
            dist.destroy_process_group()


def setup(device: torch.device) -> Runtime:
    """The runtime of this process, training on ``device`` (under torchrun on CUDA, ``LOCAL_RANK``'s GPU),
    which picks the process group's backend: NCCL on CUDA, gloo on the CPU."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1 and not dist.is_initialized():
        return Runtime(0, 1, device, owns_group=False)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    owns = not dist.is_initialized()
    if owns:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return Runtime(dist.get_rank(), dist.get_world_size(), device, owns_group=owns)
