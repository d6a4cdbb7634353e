"""The recurrent state a converted model carries from one call to the next."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from rnnify.errors import RnnifyError, StateError


@dataclass(frozen=True)
class RecurrentState:
    """Everything a converted model remembers about the sequences it has read.

    ``tensors`` are the cells' states in graph order; ``positions`` ``[B]`` counts the real
    (non-padding) tokens each row has read, which is the next token's position id. ``model_uid``
    ties the state to the model that made it.
    """

    tensors: tuple[torch.Tensor, ...]
    positions: torch.Tensor
    model_uid: str

    @property
    def batch_size(self) -> int:
        return int(self.positions.shape[0])

    @property
    def nbytes(self) -> int:
        """Bytes held by the state (cell states and positions)."""
        return sum(t.numel() * t.element_size() for t in (*self.tensors, self.positions))

    def to(self, device: torch.device | str) -> "RecurrentState":
        return replace(self, tensors=tuple(t.to(device) for t in self.tensors), positions=self.positions.to(device))

    def next_positions(self, length: int, mask: torch.Tensor | None = None) -> torch.Tensor:
        """``[B, length]`` positions of the next ``length`` tokens read into this state: its count
        continued, a ``mask`` (bool) 0 taking none (a padding column repeats its row's last position,
        the first real one's before any)."""
        if mask is None:  # every token is real: positions simply continue
            offsets = torch.arange(length, device=self.positions.device) if length > 1 else 0
            return self.positions[:, None] + offsets
        return (self.positions[:, None] + mask.long().cumsum(1) - 1).clamp_min(0)


def check_inputs(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """Shape checks (no device work); the mask as bool, or None when every token is real."""
    if (
        not isinstance(input_ids, torch.Tensor)
        or input_ids.dim() != 2
        or input_ids.dtype not in (torch.int32, torch.long)
    ):
        raise RnnifyError("input_ids must be an int64 (or int32) tensor of shape [batch, length]")
    if input_ids.shape[1] == 0:
        raise RnnifyError("input_ids is empty: give at least one token")
    if attention_mask is None:
        return None
    if attention_mask.shape != input_ids.shape:
        raise RnnifyError(
            f"attention_mask shape {tuple(attention_mask.shape)} != input_ids shape {tuple(input_ids.shape)}"
        )
    return attention_mask.to(device=input_ids.device, dtype=torch.bool)


def check_state(state: RecurrentState, model_uid: str, batch_size: int) -> None:
    """Refuse a state that is not one, was made by another model (``model_uid``), or holds another
    number of sequences than the ``batch_size`` rows it is given."""
    if not isinstance(state, RecurrentState):
        raise StateError(f"state must be a RecurrentState from init_state/prefill/step, got {type(state).__name__}")
    if state.model_uid != model_uid:
        raise StateError("this state was made by another model; start one with init_state() or prefill()")
    if state.batch_size != batch_size:
        raise StateError(
            f"state holds {state.batch_size} sequences but input_ids has {batch_size} rows; "
            "use a state from the same batch"
        )
