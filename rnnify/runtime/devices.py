"""The device a model is loaded onto or trained on, checked where the user names it, and a graph's device
constants moved with its weights."""

from __future__ import annotations

import torch
import torch.fx

from rnnify.errors import RnnifyError


def usable_device(device: torch.device | str, named: str = "device") -> torch.device:
    """``device`` as a ``torch.device`` this process can use: a name torch does not know, or CUDA where
    none is available, is one line saying so (``named``: how the user gave it, e.g. ``--device``),
    not torch's error from deep inside the first tensor moved there."""
    try:
        chosen = torch.device(device)
    except (RuntimeError, TypeError):
        raise RnnifyError(f"{named} {device!r} is not a device; use cpu, cuda or cuda:N") from None
    if chosen.type == "cuda" and not torch.cuda.is_available():
        raise RnnifyError(f"{named} {str(device)!r}: no CUDA device is available; use cpu")
    return chosen


def retarget_devices(gm: torch.fx.GraphModule, device: torch.device | str) -> None:
    """Point every ``torch.device`` constant in ``gm``'s graphs (its submodules' too) at ``device``.

    Export records devices as constants (the rotary table's ``aten.to.device(inv_freq, cpu)``), so
    a graph whose weights move to another device would otherwise copy tensors back to the first
    one (``rnnify.load(device=)`` does the same while decoding ``graph.json``).
    """
    device = torch.device(device)
    swap = lambda value: device if isinstance(value, torch.device) else value  # noqa: E731
    for module in gm.modules():
        if isinstance(module, torch.fx.GraphModule):
            for node in module.graph.nodes:
                node.args = torch.fx.node.map_aggregate(node.args, swap)
                node.kwargs = torch.fx.node.map_aggregate(node.kwargs, swap)
            module.recompile()
