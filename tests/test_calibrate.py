"""RecurrentModel.calibrate: cells that learn from data start from the queries they receive."""

from __future__ import annotations

import pytest
import torch

import rnnify


def captured_queries(model, ids):
    """q received by each cell during one prefill, recorded by hooks written here."""
    seen = {}
    handles = [
        cell.register_forward_pre_hook(lambda c, args, i=i: seen.__setitem__(i, args[0].clone()))
        for i, cell in enumerate(model.cells)
    ]
    model.prefill(ids)
    for h in handles:
        h.remove()
    return seen


def test_aaren_queries_become_the_mean_query_layer_by_layer(tiny_model_dir):
    ids = torch.randint(0, 320, (2, 24), generator=torch.Generator().manual_seed(0))
    model = rnnify.convert(tiny_model_dir("llama"), to="aaren").calibrate(ids)
    exact = rnnify.convert(tiny_model_dir("llama"), to="exact")
    # Layer 0 sees the original model's q (nothing before it differs from the original).
    q0 = captured_queries(exact, ids)[0]
    torch.testing.assert_close(model.cells[0].query, q0.mean(dim=(0, 2)))
    # Later layers calibrate on the q produced by the already calibrated layers before them.
    q1 = captured_queries(model, ids)[1]
    torch.testing.assert_close(model.cells[1].query, q1.mean(dim=(0, 2)))


def test_calibrate_needs_a_cell_that_learns(converted_dir):
    model = rnnify.load(converted_dir("llama", "linear"))
    with pytest.raises(rnnify.RnnifyError, match="calibration"):
        model.calibrate(torch.tensor([[1, 2, 3]]))
