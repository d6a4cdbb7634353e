"""Each pass on its own: the ops it must remove, the ops it must keep, what it records.

Tiny GPT-2 / Llama / Mistral models are captured once per module (copies are handed to each test,
since passes edit graphs in place); the earlier passes of ``PIPELINE`` are run to bring a graph
to the pass under test, then op counts are compared before and after it. Numbers are checked
against the original Hugging Face model. Rejections use small torch.nn models written here that
call ``scaled_dot_product_attention`` the ways a causal LM must not.
"""

from __future__ import annotations

import collections
import copy
import math
import operator
import types

import pytest
import torch
import torch.fx
import torch.nn.functional as F
from support import rel_diff
from torch import nn
from torch.export import Dim

from rnnify.cells import CELLS, Cell
from rnnify.cells.exact import ExactCell
from rnnify.cells.linear import LinearCell
from rnnify.compiler.capture import _plain_graph_module, capture, load_source
from rnnify.compiler.passes import PIPELINE, AttentionSite, PassContext, cleanup, run_pipeline
from rnnify.compiler.passes.find_attention import find_attention
from rnnify.compiler.passes.find_positions import find_positions
from rnnify.compiler.passes.rewrite_attention import rewrite_attention
from rnnify.compiler.passes.strip_export_checks import strip_export_checks
from rnnify.compiler.passes.thread_state import thread_state
from rnnify.compiler.plan import ConversionPlan
from rnnify.errors import UnsupportedModelError

aten = torch.ops.aten
SDPA = aten.scaled_dot_product_attention.default
CHECK_OPS = (aten._assert_tensor_metadata.default, aten._assert_scalar.default)
# ops that only the models' own causal/padding mask construction uses
MASK_OPS = (aten.__and__.Tensor, aten.le.Tensor, aten.diff.default, aten.new_ones.default)

# tiny configs from examples/make_tiny_model.py
EXPECTED = {
    "gpt2": dict(layers=2, num_heads=4, num_kv_heads=4, head_dim=8, gqa="none", window=None),
    "llama": dict(layers=2, num_heads=4, num_kv_heads=2, head_dim=8, gqa="repeat_kv", window=None),
    "mistral": dict(layers=2, num_heads=4, num_kv_heads=2, head_dim=8, gqa="repeat_kv", window=16),
}


# --------------------------------------------------------------------------- helpers


@pytest.fixture(scope="module")
def source(tiny_model_dir):
    """``source(arch)`` -> (HF model, a fresh copy of its captured graph)."""
    cache: dict[str, tuple] = {}

    def get(arch: str):
        if arch not in cache:
            model = load_source(tiny_model_dir(arch))
            cache[arch] = (model, capture(model))
        model, gm = cache[arch]
        return model, copy.deepcopy(gm)

    return get


def counts(gm: torch.fx.GraphModule) -> collections.Counter:
    return collections.Counter(n.target for n in gm.graph.nodes if n.op in ("call_function", "call_module"))


def run_until(gm: torch.fx.GraphModule, ctx: PassContext, stop) -> torch.fx.GraphModule:
    """Run the passes of PIPELINE that come before ``stop``."""
    return run_pipeline(gm, ctx, PIPELINE[: PIPELINE.index(stop)])


def inputs(batch: int, length: int, seed: int = 0, vocab: int = 320):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, length), generator=gen)
    return ids, torch.arange(length).expand(batch, length).contiguous()


def hf_logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def only(out) -> torch.Tensor:
    """The single output of a graph before thread_state (capture returns a 1-tuple)."""
    (tensor,) = out if isinstance(out, (tuple, list)) else (out,)
    return tensor


def cells_of(gm: torch.fx.GraphModule) -> list[Cell]:
    return [m for m in gm.modules() if isinstance(m, Cell)]


def initial_state(gm: torch.fx.GraphModule, batch: int) -> list[torch.Tensor]:
    return [t for c in cells_of(gm) for t in c.init_state(batch, torch.device("cpu"), torch.float32)]


# --------------------------------------------------------------------------- toy models for rejections


class ToyAttention(nn.Module):
    """q/k/v from one linear layer; ``mode`` says how SDPA is called."""

    def __init__(self, mode: str, width: int = 16, heads: int = 2, kv_heads: int = 2, window: int = 3):
        super().__init__()
        self.mode, self.heads, self.kv_heads, self.window = mode, heads, kv_heads, window
        self.head_dim = width // heads
        self.q = nn.Linear(width, heads * self.head_dim)
        self.kv = nn.Linear(width, 2 * kv_heads * self.head_dim)
        self.memory = nn.Parameter(torch.randn(1, kv_heads, 3, self.head_dim))  # for cross-attention
        self.out = nn.Linear(heads * self.head_dim, width)

    def forward(self, x):
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(x).view(b, t, 2, self.kv_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        if self.mode == "causal":
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        elif self.mode == "enable_gqa":
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        elif self.mode == "no_mask":  # bidirectional: no mask, is_causal=False
            o = F.scaled_dot_product_attention(q, k, v, is_causal=False)
        elif self.mode == "full_mask":  # bidirectional through an explicit all-True boolean mask
            mask = torch.ones(b, 1, t, t, dtype=torch.bool, device=x.device)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        elif self.mode == "window_mask":  # causal, last `window` keys only
            i = torch.arange(t, device=x.device)
            mask = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < self.window)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        elif self.mode == "cross":  # keys/values from a fixed 3-token memory
            memory = self.memory.expand(b, -1, -1, -1)
            o = F.scaled_dot_product_attention(q, memory, memory)
        else:
            raise ValueError(self.mode)
        return self.out(o.transpose(1, 2).reshape(b, t, -1))


class ToyLM(nn.Module):
    """``(input_ids, position_ids) -> logits`` like a causal LM: embedding, layers, head."""

    def __init__(self, modes: list[str], vocab: int = 50, width: int = 16, **attention):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(
            ToyAttention(m, width, **attention) if m != "mlp" else nn.Sequential(nn.Linear(width, width), nn.GELU())
            for m in modes
        )
        self.head = nn.Linear(width, vocab)

    def forward(self, input_ids, position_ids):
        x = self.embed(input_ids)
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)


def export_plain(module: nn.Module, vocab: int = 50) -> torch.fx.GraphModule:
    """torch.export with dynamic batch and length (min 2), then a plain GraphModule as capture makes."""
    torch.manual_seed(0)
    ids, pos = inputs(2, 8, vocab=vocab)
    dims = {0: Dim("batch", min=1, max=1024), 1: Dim("length", min=2, max=4096)}
    program = torch.export.export(module.eval(), (ids, pos), dynamic_shapes=(dims, dims), strict=False)
    return _plain_graph_module(program.module())


def find_attention_on(module: nn.Module, config=None) -> torch.fx.GraphModule:
    ctx = PassContext(config=config)
    gm = run_until(export_plain(module), ctx, find_attention)
    return cleanup(find_attention(gm, ctx))


def annotated_sites(gm: torch.fx.GraphModule) -> list[AttentionSite]:
    return [n.meta["rnnify_site"] for n in gm.graph.nodes if "rnnify_site" in n.meta]


# --------------------------------------------------------------------------- strip_export_checks


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_strip_export_checks_removes_every_check_and_keeps_the_logits(source, arch):
    model, gm = source(arch)
    before = counts(gm)
    ids, pos = inputs(2, 6)
    with torch.no_grad():
        logits_before = only(gm(ids, pos))
    assert sum(before[op] for op in CHECK_OPS) > 0  # export left its dtype/device checks

    gm = cleanup(strip_export_checks(gm, PassContext(config=model.config)))
    after = counts(gm)

    assert sum(after[op] for op in CHECK_OPS) == 0
    # the computation itself is untouched
    for op in (SDPA, aten.embedding.default, aten.layer_norm.default, aten.linear.default, aten.addmm.default):
        assert after[op] == before[op], op
    with torch.no_grad():
        assert torch.equal(only(gm(ids, pos)), logits_before)
        assert rel_diff(logits_before, hf_logits(model, ids)) <= 1e-5
        one = only(gm(ids[:, :1], pos[:, :1]))  # single-token calls are what the recurrent graph is for
    assert rel_diff(one, hf_logits(model, ids[:, :1])) <= 1e-5


class _DataDependent(nn.Module):
    def forward(self, x):
        n = x.sum().long().item()
        torch._check(n >= 0)
        torch._check(n < 1000)
        return x * n


def test_strip_export_checks_removes_assert_scalar_and_the_range_it_enforced():
    gm = _plain_graph_module(torch.export.export(_DataDependent(), (torch.ones(3),), strict=False).module())
    before = counts(gm)
    assert before[aten._assert_scalar.default] >= 2 and before[aten._assert_tensor_metadata.default] >= 1
    big = torch.full((3,), 1000.0)  # sum 3000: outside the range export recorded
    with pytest.raises(RuntimeError):
        gm(big)

    gm = cleanup(strip_export_checks(gm, PassContext()))
    after = counts(gm)
    assert sum(after[op] for op in CHECK_OPS) == 0
    assert after[aten.mul.Tensor] == before[aten.mul.Tensor] == 1
    assert torch.equal(only(gm(big)), big * 3000)


# --------------------------------------------------------------------------- find_positions


@pytest.mark.parametrize("arch", ["gpt2", "llama", "mistral"])
def test_find_positions(source, arch):
    model, gm = source(arch)
    ctx = PassContext(config=model.config)
    gm = run_until(gm, ctx, find_positions)
    before = counts(gm)
    gm = cleanup(find_positions(gm, ctx))
    assert counts(gm) == before  # records only
    if arch == "gpt2":
        # learned absolute positions: the wpe table bounds decoding
        assert ctx.positions == {"kind": "learned", "limit": 128}
        assert model.config.n_positions == 128 == model.transformer.wpe.weight.shape[0]
    else:
        # rotary: relative, max_position_embeddings only as a warning limit
        assert ctx.positions == {"kind": "relative", "limit": model.config.max_position_embeddings}
        assert ctx.positions["limit"] == {"llama": 128, "mistral": 256}[arch]


def test_find_positions_without_position_embedding_or_config():
    ctx = PassContext(config=None)
    gm = run_until(export_plain(ToyLM(["causal"])), ctx, find_positions)
    find_positions(gm, ctx)
    assert ctx.positions == {"kind": "relative", "limit": None}


# --------------------------------------------------------------------------- find_attention


@pytest.mark.parametrize("arch", ["gpt2", "llama", "mistral"])
def test_find_attention_describes_every_layer(source, arch):
    model, gm = source(arch)
    expected = EXPECTED[arch]
    ctx = PassContext(config=model.config)
    gm = run_until(gm, ctx, find_attention)
    before, names = counts(gm), [n.name for n in gm.graph.nodes]

    gm = cleanup(find_attention(gm, ctx))

    assert counts(gm) == before and [n.name for n in gm.graph.nodes] == names  # graph unchanged
    sdpa = [n for n in gm.graph.nodes if n.target == SDPA]
    assert len(sdpa) == expected["layers"] == model.config.num_hidden_layers
    assert all("rnnify_site" in n.meta for n in sdpa)
    found = [n.meta["rnnify_site"] for n in sdpa]
    assert [s.layer for s in found] == list(range(expected["layers"]))
    assert [s.index for s in found] == list(range(expected["layers"]))
    for node, site in zip(sdpa, found):
        assert isinstance(site, AttentionSite)
        assert str(site.layer) in site.module_path.split(".")
        assert f"layer {site.layer}" in site.where
        assert (site.num_heads, site.num_kv_heads, site.head_dim, site.value_dim) == (
            expected["num_heads"],
            expected["num_kv_heads"],
            expected["head_dim"],
            expected["head_dim"],
        )
        assert site.gqa == expected["gqa"]
        assert site.window == expected["window"]
        assert site.scale == pytest.approx(1 / math.sqrt(expected["head_dim"]), rel=1e-12)
        assert site.query is node.args[0]
        # recurrent state lives at kv-head size: k/v are taken from before repeat_kv
        assert site.key.meta["val"].shape[1] == expected["num_kv_heads"]
        assert site.value.meta["val"].shape[1] == expected["num_kv_heads"]
        if expected["gqa"] == "repeat_kv":
            assert site.key is not node.args[1] and site.value is not node.args[2]
            assert node.args[1].meta["val"].shape[1] == expected["num_heads"]
        else:
            assert site.key is node.args[1] and site.value is node.args[2]


def test_find_attention_enable_gqa():
    gm = find_attention_on(ToyLM(["enable_gqa", "enable_gqa"], heads=4, kv_heads=2))
    found = annotated_sites(gm)
    assert [(s.layer, s.num_heads, s.num_kv_heads, s.head_dim, s.gqa) for s in found] == [
        (0, 4, 2, 4, "enable_gqa"),
        (1, 4, 2, 4, "enable_gqa"),
    ]
    assert all(s.mask_source == "is_causal" and s.scale == pytest.approx(0.5) for s in found)


def test_find_attention_accepts_a_window_mask_the_config_declares():
    gm = find_attention_on(ToyLM(["window_mask", "window_mask"], window=3), types.SimpleNamespace(sliding_window=3))
    assert [s.window for s in annotated_sites(gm)] == [3, 3]


def test_find_attention_rejects_a_window_mask_the_config_does_not_declare():
    with pytest.raises(UnsupportedModelError, match=r"layer 0 \(layers\.0\).*unsupported attention mask"):
        find_attention_on(ToyLM(["window_mask", "causal"], window=3))


@pytest.mark.parametrize("mode", ["no_mask", "full_mask"])
def test_find_attention_rejects_bidirectional_attention(mode):
    # layer 0 is causal, layer 1 is not: the error must name layer 1
    with pytest.raises(UnsupportedModelError, match=r"layer 1 \(layers\.1\).*not causal"):
        find_attention_on(ToyLM(["causal", mode]))


def test_find_attention_rejects_cross_attention():
    with pytest.raises(UnsupportedModelError, match=r"layer 1 \(layers\.1\).*cross-attention"):
        find_attention_on(ToyLM(["causal", "cross"]))


def test_find_attention_rejects_a_model_without_attention():
    with pytest.raises(UnsupportedModelError, match="no attention"):
        find_attention_on(ToyLM(["mlp", "mlp"]))


# --------------------------------------------------------------------------- rewrite_attention


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_rewrite_attention_replaces_each_sdpa_with_a_cell(source, arch):
    model, gm = source(arch)
    layers = EXPECTED[arch]["layers"]
    ctx = PassContext(config=model.config, plan=ConversionPlan("exact"))
    gm = run_until(gm, ctx, rewrite_attention)
    found = annotated_sites(gm)
    before = counts(gm)
    assert before[SDPA] == layers
    assert all(before[op] > 0 for op in MASK_OPS)

    gm = cleanup(rewrite_attention(gm, ctx))
    after = counts(gm)

    assert after[SDPA] == 0
    calls = [n for n in gm.graph.nodes if n.op == "call_module"]
    assert [n.target for n in calls] == [f"cells.{i}" for i in range(layers)]
    for call, site in zip(calls, found):
        cell = gm.get_submodule(call.target)
        assert isinstance(cell, ExactCell)
        assert (cell.spec.num_heads, cell.spec.num_kv_heads, cell.spec.head_dim, cell.spec.scale, cell.spec.window) == (
            site.num_heads,
            site.num_kv_heads,
            site.head_dim,
            site.scale,
            site.window,
        )
        assert call.args == (site.query, site.key, site.value)
        # the SDPA result's users now read output 0 of the cell
        assert all(u.target is operator.getitem and u.args[1] == 0 for u in call.users)
    # the model's mask was only for SDPA: its construction is dead now
    assert all(after[op] == 0 for op in MASK_OPS)
    # everything else stays
    for op in (aten.embedding.default, aten.layer_norm.default, aten.linear.default, aten.addmm.default):
        assert after[op] == before[op], op


def test_rewrite_attention_uses_target_and_options(source):
    model, gm = source("llama")
    ctx = PassContext(config=model.config, plan=ConversionPlan("linear", options={"chunk_size": 5}))
    gm = cleanup(rewrite_attention(run_until(gm, ctx, rewrite_attention), ctx))
    cells = [gm.get_submodule(f"cells.{i}") for i in range(2)]
    assert all(isinstance(c, LinearCell) and c.chunk_size == 5 for c in cells)


class _ParamCell(Cell):
    """A cell with a parameter, to see that rewrite_attention registers cells as submodules."""

    target = "param_test"
    state_names = ()

    def __init__(self, spec):
        super().__init__(spec)
        self.gain = nn.Parameter(torch.full((spec.num_heads,), 2.0))

    def options(self):
        return {}

    def init_state(self, batch_size, device, dtype):
        return ()

    def forward(self, q, k, v, *rest):
        return (q * self.gain[None, :, None, None],)


def test_rewrite_attention_registers_cell_parameters(source, monkeypatch):
    monkeypatch.setitem(CELLS, "param_test", _ParamCell)
    model, gm = source("llama")
    ctx = PassContext(config=model.config, plan=ConversionPlan("param_test"))
    gm = cleanup(rewrite_attention(run_until(gm, ctx, rewrite_attention), ctx))  # cleanup must keep them
    state = gm.state_dict()
    for i in range(2):
        assert f"cells.{i}.gain" in state
        assert torch.equal(state[f"cells.{i}.gain"], torch.full((4,), 2.0))
        assert any(p is gm.get_submodule(f"cells.{i}").gain for p in gm.parameters())


# --------------------------------------------------------------------------- thread_state


@pytest.mark.parametrize("arch", ["gpt2", "llama", "mistral"])
def test_thread_state_signature_and_outputs(source, arch):
    model, gm = source(arch)
    layers = EXPECTED[arch]["layers"]
    captured = counts(gm)
    ctx = PassContext(config=model.config, plan=ConversionPlan("exact"))
    gm = run_until(gm, ctx, thread_state)
    assert [n.name for n in gm.graph.nodes if n.op == "placeholder"] == ["input_ids", "position_ids"]

    gm = cleanup(thread_state(gm, ctx))

    state_names = [f"state_{i}_{name}" for i in range(layers) for name in ExactCell.state_names]
    assert [n.name for n in gm.graph.nodes if n.op == "placeholder"] == [
        "input_ids",
        "position_ids",
        "attention_mask",
        *state_names,
    ]
    (outputs,) = gm.graph.output_node().args
    assert len(outputs) == 1 + layers * len(ExactCell.state_names)
    calls = [n for n in gm.graph.nodes if n.op == "call_module"]
    for i, call in enumerate(calls):
        assert [a.name for a in call.args[3:]] == ["attention_mask", *state_names[3 * i : 3 * i + 3]]
    # the model's mask construction (present in the capture) is gone from the final graph
    final = counts(gm)
    assert all(captured[op] > 0 for op in MASK_OPS)
    assert all(final[op] == 0 for op in MASK_OPS)
    assert final[SDPA] == 0


@pytest.mark.parametrize("arch", ["gpt2", "llama", "mistral"])
@pytest.mark.parametrize("length", [1, 7, 40])
def test_thread_state_exact_graph_equals_hf_model(source, arch, length):
    model, gm = source(arch)
    ctx = PassContext(config=model.config, plan=ConversionPlan("exact"))
    gm = cleanup(thread_state(run_until(gm, ctx, thread_state), ctx))
    ids, pos = inputs(2, length, seed=length)
    with torch.no_grad():
        logits, *state = gm(ids, pos, torch.ones(2, length, dtype=torch.bool), *initial_state(gm, 2))
    assert rel_diff(logits, hf_logits(model, ids)) <= 1e-5
    # one state triple per layer, holding every key (Mistral: at most its 16-token window)
    kept = min(length, 16) if arch == "mistral" else length
    assert [s.shape[-2] if s.dim() == 4 else s.shape[-1] for s in state] == [kept] * len(state)


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_thread_state_exact_graph_decodes_token_by_token(source, arch):
    # prefill 5 tokens, then feed the returned state back one token at a time: every logit row
    # equals the HF model's on the whole sequence (Mistral runs past its 16-token window)
    model, gm = source(arch)
    ctx = PassContext(config=model.config, plan=ConversionPlan("exact"))
    gm = cleanup(thread_state(run_until(gm, ctx, thread_state), ctx))
    ids, pos = inputs(2, 24, seed=1)
    ones = torch.ones(2, 24, dtype=torch.bool)
    rows = []
    with torch.no_grad():
        logits, *state = gm(ids[:, :5], pos[:, :5], ones[:, :5], *initial_state(gm, 2))
        rows.append(logits)
        for t in range(5, 24):
            logits, *state = gm(ids[:, t : t + 1], pos[:, t : t + 1], ones[:, t : t + 1], *state)
            rows.append(logits)
    assert rel_diff(torch.cat(rows, dim=1), hf_logits(model, ids)) <= 1e-5


def test_thread_state_linear_state_has_constant_size(source):
    model, gm = source("llama")
    ctx = PassContext(config=model.config, plan=ConversionPlan("linear"))
    gm = cleanup(thread_state(run_until(gm, ctx, thread_state), ctx))
    assert [n.name for n in gm.graph.nodes if n.op == "placeholder"][3:] == [
        "state_0_kv",
        "state_0_k_sum",
        "state_1_kv",
        "state_1_k_sum",
    ]
    shapes = set()
    for length in (2, 9):
        ids, pos = inputs(1, length)
        with torch.no_grad():
            logits, *state = gm(ids, pos, torch.ones(1, length, dtype=torch.bool), *initial_state(gm, 1))
        assert logits.shape == (1, length, 320) and torch.isfinite(logits).all()
        shapes.add(tuple(tuple(s.shape) for s in state))
    assert shapes == {((1, 2, 8, 8), (1, 2, 8), (1, 2, 8, 8), (1, 2, 8))}


def convert_toy(toy: nn.Module, config=None) -> torch.fx.GraphModule:
    ctx = PassContext(config=config, plan=ConversionPlan("exact"))
    return run_pipeline(export_plain(toy), ctx)


@pytest.mark.parametrize(
    "modes, config, attention",
    [
        (["enable_gqa", "enable_gqa"], None, {"heads": 4, "kv_heads": 2}),  # GQA without repeat_kv
        (["window_mask", "window_mask"], types.SimpleNamespace(sliding_window=3), {"window": 3}),
    ],
    ids=["enable_gqa", "window_3"],
)
def test_thread_state_exact_graph_equals_toy_model(modes, config, attention):
    torch.manual_seed(0)
    toy = ToyLM(modes, **attention).eval()
    assert_equals_toy(convert_toy(toy, config), toy, seed=3)


def assert_equals_toy(gm: torch.fx.GraphModule, toy: nn.Module, seed: int) -> None:
    """The converted graph's logits from a fresh state are the toy model's."""
    ids, pos = inputs(2, 12, seed=seed, vocab=50)
    with torch.no_grad():
        want = toy(ids, pos)
        got, *_ = gm(ids, pos, torch.ones(2, 12, dtype=torch.bool), *initial_state(gm, 2))
    assert rel_diff(got, want) <= 1e-5


def test_find_attention_does_not_trust_a_config_window_the_probe_contradicts():
    """The documented contract (``find_attention._check_causal``): when the graph attends to the full
    causal past although the config claims a shorter window, the graph is the truth: no window."""
    torch.manual_seed(0)
    toy = ToyLM(["causal", "causal"]).eval()  # full causal attention, no window
    config = types.SimpleNamespace(sliding_window=3)  # a config that claims a window of 3
    gm = convert_toy(toy, config)
    assert [cell.spec.window for cell in cells_of(gm)] == [None, None]
    assert_equals_toy(gm, toy, seed=4)
