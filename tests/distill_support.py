"""Helpers the distillation tests share: a free port for process groups, losses recorded per step."""

from __future__ import annotations

import socket

import rnnify
from rnnify.distillation import train


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def distill_recording_losses(model_dir, data, **options) -> tuple[list[float], rnnify.RecurrentModel]:
    """``rnnify.distill`` of the model in ``model_dir``, and the loss of every optimizer step."""
    losses, step = [], train._Trainer.step

    def recording(self, *args):
        loss, count = step(self, *args)
        losses.append(loss)
        return loss, count

    train._Trainer.step = recording
    try:
        model = rnnify.distill(rnnify.load(model_dir), data, **options)
    finally:
        train._Trainer.step = step
    return losses, model
