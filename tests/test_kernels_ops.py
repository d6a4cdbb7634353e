"""rnnify.kernels' ops as a whole: ``backend=`` picks the path (Triton or the PyTorch reference),
torch.export captures every op through its fake implementation, torch.library.opcheck passes, and
the kernels compile for sm_90 (slow; needs a CUDA toolchain). Triton under TRITON_INTERPRET=1 on CPU.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

# every test here runs the Triton path: the whole file is skipped without triton (an extra, "rnnify[triton]")
pytest.importorskip("triton", reason="triton is not installed: the kernels' Triton paths cannot be tested")

from kernel_support import close, left_padding, make_attn, nan_buffers, no_reference  # noqa: F401 - fixtures, nan_buffers autouse

import rnnify.kernels as K
from rnnify.errors import RnnifyError
from rnnify.kernels import utils

# --------------------------------------------------------------------------- backend=


def _call_each_op(backend):
    """Every public op once, small, with ``backend``; returns their outputs."""
    q, k, v, g, _, h0 = make_attn(1, 5, 2, 1, 16, 16, "g")
    ring = k.new_zeros(1, 1, 4, 16)
    return [
        K.fused_recurrent_linear_attn(q, k, v, g, initial_state=h0, backend=backend)[0],
        K.chunk_linear_attn(q, k, v, g, initial_state=h0, backend=backend)[0],
        K.linear_recurrence(k[:, :, 0, :3].sigmoid(), v[:, :, 0, :3], backend=backend)[0],
        K.aaren_scan(q[..., 0], q, backend=backend)[0],
        K.window_attn_step(q[:, :1], k[:, :1], v[:, :1], ring, ring, torch.zeros(1, dtype=torch.long), backend=backend)[
            0
        ],
    ]


def test_resolve_backend(monkeypatch):
    x = torch.zeros(1)
    assert utils.BACKENDS == ("auto", "triton", "reference")
    monkeypatch.setattr(utils, "FORCE_TRITON", False)
    assert [utils.resolve_backend(b, x) for b in utils.BACKENDS] == [False, True, False]
    monkeypatch.setattr(utils, "FORCE_TRITON", True)
    assert [utils.resolve_backend(b, x) for b in utils.BACKENDS] == [True, True, False]
    with pytest.raises(RnnifyError, match="unknown kernels 'cuda'; choose from: auto, triton, reference$"):
        utils.resolve_backend("cuda", x)
    monkeypatch.setattr(utils, "INTERPRET", False)
    with pytest.raises(RnnifyError, match="TRITON_INTERPRET"):
        utils.resolve_backend("triton", x)
    assert not utils.resolve_backend("reference", x)
    monkeypatch.setattr(utils, "HAS_TRITON", False)
    with pytest.raises(RnnifyError, match="cannot be imported"):
        utils.resolve_backend("triton", x)
    assert not utils.resolve_backend("auto", x)


def test_backend_pins_the_path(monkeypatch):
    """ "triton" runs the kernels with FORCE_TRITON off; "reference" runs none with it on; both agree."""
    calls = []
    nan_empty = utils.empty
    monkeypatch.setattr(utils, "empty", lambda *a, **kw: calls.append(1) or nan_empty(*a, **kw))
    monkeypatch.setattr(utils, "FORCE_TRITON", False)
    triton_out = _call_each_op("triton")
    assert len(calls) >= 5
    monkeypatch.setattr(utils, "FORCE_TRITON", True)
    calls.clear()
    ref_out = _call_each_op("reference")
    assert not calls
    for a, b in zip(triton_out, ref_out):
        close(a, b)
    for op in (K.chunk_linear_attn, K.fused_recurrent_linear_attn):
        with pytest.raises(RnnifyError, match="unknown kernels 'gpu'"):
            op(*make_attn(1, 2, 1, 1, 4, 4, "")[:3], backend="gpu")
    with pytest.raises(RnnifyError, match="unknown kernels 'none'"):  # a model's choice, not an op's backend
        q = make_attn(1, 2, 1, 1, 4, 4, "")[0]
        K.aaren_scan(q[..., 0], q, backend="none")


def test_backend_in_autograd(no_reference):
    """The pinned backend reaches the backward: "triton" differentiates with the kernels."""
    q, k, v, g, gk, h0 = make_attn(1, 9, 2, 1, 16, 16, "g+gk")
    leaves = [x.requires_grad_() for x in (q, k, v, g, gk, h0)]
    o, h = K.chunk_linear_attn(q, k, v, g, gk, initial_state=h0, output_final_state=True, backend="triton")
    grads = torch.autograd.grad(o.sum() + h.sum(), leaves)
    ref = K.naive_recurrent_linear_attn(q, k, v, g, gk, initial_state=h0, output_final_state=True)
    for a, b in zip(grads, torch.autograd.grad(ref[0].sum() + ref[1].sum(), leaves)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-4)


# --------------------------------------------------------------------------- export (fake impls)


class _Ops(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("hedgehog", torch.randn(1, 16, 6))

    def forward(self, q, k, v, g, h0, a):
        o1, h1 = K.fused_recurrent_linear_attn(
            q, k, v, g=g, initial_state=h0, output_final_state=True, backend="reference"
        )
        o2, h2 = K.chunk_linear_attn(q, k, v, g=g, initial_state=h0, output_final_state=True, normalize=False)
        x, hx = K.linear_recurrence(a, v[:, :, 0], reverse=True, output_final_state=True)
        o3, (m, u, w) = K.aaren_scan(q[..., 0], q, output_final_state=True)
        ring = k.new_zeros(k.shape[0], k.shape[2], 4, k.shape[3])
        o4, _ = K.window_attn_step(q[:, :1], k[:, :1], v[:, :1], ring, ring, torch.zeros(k.shape[0], dtype=torch.long))
        o5, h5 = K.chunk_linear_attn(
            q, k, v, output_final_state=True, normalize=True, feature_map="hedgehog", feature_weight=self.hedgehog
        )  # the state has 12 features
        return o1 + o2, h1 + h2, x, hx, o3, m, u, w, o4, o5, *h5


def test_export():
    q, k, v, g, _, h0 = make_attn(1, 5, 2, 1, 16, 16, "g")
    args = (q, k, v, g, h0, torch.rand(1, 5, 16))
    model = _Ops()
    ep = torch.export.export(model, args)
    targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    for name in (
        "fused_recurrent_linear_attn",
        "chunk_linear_attn",
        "linear_recurrence",
        "aaren_scan",
        "window_attn_step",
    ):
        assert any(name in t for t in targets), (name, targets)
    for a, b in zip(ep.module()(*args), model(*args)):
        close(a, b)


def opcheck_cases():
    q, k, v, g, _, h0 = make_attn(1, 5, 2, 1, 16, 8, "g")
    w = torch.randn(1, 16, 6)
    s, a = torch.randn(1, 5, 2), torch.rand(1, 5, 3)
    aaren_state = (torch.randn(1, 2), torch.rand(1, 2) + 0.5, torch.randn(1, 2, 8))
    keys, values, valid = torch.randn(1, 1, 7, 16), torch.randn(1, 1, 7, 8), torch.rand(1, 7) > 0.3
    ops = torch.ops.rnnify
    return [
        (ops.chunk_linear_attn, (q, k, v, g, None, h0, 0.25)),
        (ops.fused_recurrent_linear_attn, (q, k, v, g, None, h0, 0.25)),
        (ops.chunk_linear_attn, (q, k, v, g, None, h0[:, :, :12], 0.25, "hedgehog", w, True)),
        (ops.fused_recurrent_linear_attn, (q, k, v, g, None, None, 0.25, "performer", w, True)),
        (ops.chunk_linear_attn, (q, k, v, g, None, h0, 0.25, "elu"), {"mask": left_padding(1, 5)}),
        (ops.fused_recurrent_linear_attn, (q, k, v, g, None, h0, 0.25), {"mask": left_padding(1, 5)}),
        (ops.linear_recurrence, (a, s[..., :1].expand(1, 5, 3).contiguous(), None, False)),
        (ops.aaren_scan, (s, v[:, :, :1].expand(1, 5, 2, 8).contiguous(), *aaren_state)),
        (ops.window_attn_step, (q[:, 0], keys, values, valid, 0.25)),
    ]


@pytest.mark.parametrize("backend", ["triton", pytest.param("reference", marks=pytest.mark.slow)])
def test_opcheck(backend):
    """torch.library.opcheck: schemas, fake impls, autograd registration, and the backward traced
    by AOT autograd (the Triton backward runs through its own custom ops for that)."""
    for op, args, *kwargs in opcheck_cases():
        args = [x.clone().requires_grad_(x.is_floating_point()) if isinstance(x, torch.Tensor) else x for x in args]
        torch.library.opcheck(op, args, {"backend": backend, **(kwargs[0] if kwargs else {})})


# --------------------------------------------------------------------------- compiled for a GPU


@pytest.mark.slow
def test_kernels_compile_for_sm90():
    """What the interpreter cannot check: every kernel compiles to sm_90 and fits its shared memory."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, "-m", "rnnify.kernels.compile_check"], env=env, capture_output=True, text=True, timeout=900
    )
    assert run.returncode == 0, run.stdout + run.stderr
