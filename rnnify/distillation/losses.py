"""Token-level losses of fine-tuning, as sums over real tokens with their counts.

Sums, not means, so that a data-parallel run can divide by the token count of the whole global
batch and match a single process exactly (ranks may hold different numbers of real tokens).
Batches are right-padded and the models run without a mask: position t is real when
``mask[:, t]`` is True, and only real positions enter a loss.

Both losses come from one pass over the logits, a chunk of positions at a time, with their
gradient written in closed form (softmax minus the target distribution): on a 49k-token
vocabulary, autograd's version of the same sums kept several ``[B, T, V]`` fp32 intermediates
(log-softmax of student and teacher, their exponentials and products) and went over them again
in backward, which cost more than the LM head itself.
"""

from __future__ import annotations

import torch

__all__ = ["token_losses"]

_CHUNK_ELEMENTS = 1 << 22  # positions per chunk x vocabulary: 16 MiB of fp32 per intermediate


def token_losses(
    logits: torch.Tensor, input_ids: torch.Tensor, mask: torch.Tensor, teacher: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """``(ce_sum, ce_count, kl_sum, kl_count)`` of ``logits [B, T, V]`` (differentiable, fp32).

    ``ce_sum``: the sum of -log p(x_{t+1} | x_<=t) over t with both t and t+1 real. ``kl_sum``: the
    sum of KL(teacher || student) of the next-token distributions over real t, with ``teacher``
    the teacher's logits ``[B, T, V]`` (no gradient); None without a teacher.
    """
    mask = mask.to(torch.bool)
    keep = torch.zeros_like(mask)
    keep[:, :-1] = mask[:, :-1] & mask[:, 1:]
    targets = torch.zeros_like(input_ids)
    targets[:, :-1] = input_ids[:, 1:]
    ce, kl = _TokenLosses.apply(logits, targets, keep, teacher, mask)
    return ce, keep.sum(), (kl if teacher is not None else None), mask.sum()


class _TokenLosses(torch.autograd.Function):
    """Sums of cross-entropy and KL over chunks of positions; backward recomputes each chunk's softmaxes."""

    @staticmethod
    def forward(ctx, logits, targets, keep, teacher, mask):
        vocab = logits.shape[-1]
        flat = logits.reshape(-1, vocab)
        flat_teacher = teacher.reshape(-1, vocab) if teacher is not None else None
        targets, keep, mask = targets.reshape(-1), keep.reshape(-1), mask.reshape(-1)
        ce = torch.zeros((), dtype=torch.float32, device=logits.device)
        kl = torch.zeros((), dtype=torch.float32, device=logits.device)
        for rows in _chunks(flat.shape[0], vocab):
            log_q = torch.log_softmax(flat[rows].float(), dim=-1)
            picked = log_q.gather(1, targets[rows, None])[:, 0]
            ce -= torch.where(keep[rows], picked, 0.0).sum()
            if flat_teacher is not None:
                log_p = torch.log_softmax(flat_teacher[rows].float(), dim=-1)
                per_row = (log_p.exp() * (log_p - log_q)).sum(-1)
                kl += torch.where(mask[rows], per_row, 0.0).sum()
        ctx.save_for_backward(flat, targets, keep, flat_teacher, mask)
        ctx.shape = logits.shape
        return ce, kl

    @staticmethod
    def backward(ctx, grad_ce, grad_kl):
        flat, targets, keep, flat_teacher, mask = ctx.saved_tensors
        vocab = flat.shape[-1]
        grad = torch.empty_like(flat)
        for rows in _chunks(flat.shape[0], vocab):
            q = torch.softmax(flat[rows].float(), dim=-1)
            # d CE / dz = q - onehot(target); d KL(p || q) / dz = q - p
            g = q * torch.where(keep[rows], grad_ce, 0.0)[:, None]
            g.scatter_add_(1, targets[rows, None], -torch.where(keep[rows], grad_ce, 0.0)[:, None])
            if flat_teacher is not None:
                weight = torch.where(mask[rows], grad_kl, 0.0)[:, None]
                g += weight * (q - torch.softmax(flat_teacher[rows].float(), dim=-1))
            grad[rows] = g.to(grad.dtype)
        return grad.reshape(ctx.shape), None, None, None, None


def _chunks(n: int, vocab: int) -> list[slice]:
    size = max(1, _CHUNK_ELEMENTS // vocab)
    return [slice(start, min(start + size, n)) for start in range(0, n, size)]
