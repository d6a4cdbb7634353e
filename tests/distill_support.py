"""Helpers the distillation tests share: small settings, token rows, tiny converted models to distil
(module fixtures), a free port for process groups, losses recorded per step."""

from __future__ import annotations

import socket

import pytest
import torch

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


FAST = dict(seq_len=16, batch_size=4, progress=False)


def tokens(rows: int, seed: int = 0, vocab: int = 320, length: int = 16) -> torch.Tensor:
    return torch.randint(0, vocab, (rows, length), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def hedgehog_dir(tmp_path_factory, tiny_model_dir):
    """Llama converted to linear attention with the trainable hedgehog feature map."""
    out = tmp_path_factory.mktemp("hedgehog") / "model"
    rnnify.convert(tiny_model_dir("llama"), to="linear", feature_map="hedgehog").save(out)
    return out


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory, tiny_model_dir):
    """Llama converted to LoLCATs' hybrid with a window shorter than the training rows."""
    out = tmp_path_factory.mktemp("hybrid") / "model"
    rnnify.convert(tiny_model_dir("llama"), to="hybrid", window=4, feature_map="hedgehog").save(out)
    return out


@pytest.fixture(scope="module")
def aaren_dir(tmp_path_factory, tiny_model_dir):
    """Llama converted to Aaren, whose cells ignore the layer's q (a learned query instead)."""
    out = tmp_path_factory.mktemp("aaren") / "model"
    rnnify.convert(tiny_model_dir("llama"), to="aaren").save(out)
    return out
