"""Token-level losses of fine-tuning, as sums over real tokens with their counts.

Sums, not means, so that a data-parallel run can divide by the token count of the whole global
batch and match a single process exactly (ranks may hold different numbers of real tokens).
Batches are right-padded and the models run without a mask: position t is real when
``mask[:, t]`` is True, and only real positions enter a loss.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["kl_sum", "next_token_sum"]


def next_token_sum(logits: torch.Tensor, input_ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum of -log p(x_{t+1} | x_<=t), count)`` over t with both t and t+1 real (fp32)."""
    keep = mask[:, :-1] & mask[:, 1:]
    nll = F.cross_entropy(logits[:, :-1].float().transpose(1, 2), input_ids[:, 1:], reduction="none")
    return (nll * keep).sum(), keep.sum()


def kl_sum(student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum of KL(teacher || student), count)`` of the next-token distributions at real positions (fp32)."""
    log_p = F.log_softmax(teacher.float(), dim=-1)
    log_q = F.log_softmax(student.float(), dim=-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    return (kl * mask).sum(), mask.sum()
