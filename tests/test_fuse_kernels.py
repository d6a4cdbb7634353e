"""The fuse_kernels pass: which cells run the rnnify.kernels ops, that the Triton path (through the
interpreter, TRITON_INTERPRET=1 from conftest) gives the reference path's logits and both the
cells' own PyTorch forms', and how the backend is saved, overridden at load and chosen on the CLI."""

from __future__ import annotations

import collections
import json

import pytest
import torch
from kernel_support import needs_triton
from support import decode, rel_diff

import rnnify
from rnnify.cells import CellSpec, build_cell
from rnnify.cells.linear import KERNEL_MAX_FEATURES
from rnnify.cli import main
from rnnify.compiler.capture import capture, load_source
from rnnify.compiler.passes import PIPELINE, PassContext, cleanup
from rnnify.compiler.passes.fuse_kernels import KERNELS_KEY, fuse_kernels
from rnnify.compiler.passes.rewrite_attention import cell_calls
from rnnify.compiler.plan import make_plan
from rnnify.kernels import utils
from rnnify.runtime.manifest import MANIFEST_FILE

LINEAR_OPS = {"prefill": "chunk_linear_attn", "decode": "fused_recurrent_linear_attn"}
HYBRID_OPS = {"prefill": "chunk_linear_attn", "decode": "window_attn_step + fused_recurrent_linear_attn"}

# Every family with a fused form. The interpreter is slowest on the scans: one such layer there.
FAMILIES = {
    "linear": ("linear", {}),
    "linear-hedgehog": ("linear", {"feature_map": "hedgehog"}),
    "linear-performer": ("linear", {"feature_map": "performer"}),
    "gated-retnet": ("gated", {"gate": "retnet"}),
    "gated-gla": ("gated", {"gate": "gla"}),
    "gated-gateloop": ("gated", {"gate": "gateloop", "feature_map": "identity", "normalize": False}),
    "aaren": ("aaren", {"layers": "0:exact"}),
    "gated-rnn": ("gated-rnn", {"decay": 0.9, "layers": "0:exact"}),
    "window": ("window", {"window": 4, "sinks": 1}),
    # memory_init: with the memory gated off the linear half would not reach the outputs; sinks:
    # tokens 2.. leave the ring for the memory, 0 and 1 stay attended through window_attn_step
    "hybrid": ("hybrid", {"window": 3, "sinks": 2, "memory_init": 0.5, "feature_map": "elu"}),
    "hybrid-hedgehog": ("hybrid", {"window": 4, "feature_map": "hedgehog", "memory_init": 0.5, "sinks": 0}),
    "gated-delta": ("gated-delta", {"layers": "0:exact"}),
}


@pytest.fixture(scope="module")
def llama_graph(tiny_model_dir):
    """The tiny Llama's graph after every pass before fuse_kernels, with a plan of three targets."""

    def get() -> tuple[torch.fx.GraphModule, PassContext]:
        ctx = PassContext(config=None, plan=make_plan("linear", layers="0:exact"), kernels="none")
        source = load_source(tiny_model_dir("llama"))
        ctx.config = source.config
        gm = capture(source)
        for pass_ in PIPELINE[: PIPELINE.index(fuse_kernels)]:
            gm = cleanup(pass_(gm, ctx))
        return gm, ctx

    return get


def fused_counts(gm: torch.fx.GraphModule) -> collections.Counter:
    return collections.Counter(op for call in cell_calls(gm) for op in call.meta.get(KERNELS_KEY, {}).values())


# -- the pass -------------------------------------------------------------------------------


def test_pass_fuses_cells_that_have_a_fused_form(llama_graph):
    gm, ctx = llama_graph()
    graph_before = str(gm.graph)
    ctx.kernels = "reference"
    gm = cleanup(fuse_kernels(gm, ctx))
    exact, linear = (gm.get_submodule(call.target) for call in cell_calls(gm))
    assert (exact.target, exact.kernels) == ("exact", None)
    assert (linear.target, linear.kernels) == ("linear", "reference")
    assert [call.meta.get(KERNELS_KEY) for call in cell_calls(gm)] == [None, LINEAR_OPS]
    assert fused_counts(gm) == {"chunk_linear_attn": 1, "fused_recurrent_linear_attn": 1}
    assert str(gm.graph) == graph_before  # the graph is unchanged: the cells choose the op per call

    ctx.kernels = "none"
    gm = fuse_kernels(gm, ctx)
    assert fused_counts(gm) == {} and linear.kernels is None


def test_pass_rejects_an_unknown_backend(llama_graph):
    gm, ctx = llama_graph()
    ctx.kernels = "cuda"
    with pytest.raises(rnnify.RnnifyError, match="unknown kernels 'cuda'.*auto, triton, reference"):
        fuse_kernels(gm, ctx)


def test_wide_feature_maps_keep_the_pytorch_forms():
    spec = CellSpec(4, 2, 8, 8, 8**-0.5)

    def performer(target: str, features: int):
        return build_cell(target, spec, {"feature_map": "performer", "feature_options": {"num_features": features}})

    for target in ("linear", "hybrid"):
        fits = performer(target, KERNEL_MAX_FEATURES)
        ops = fits.use_kernels("triton")
        assert ops == (HYBRID_OPS if target == "hybrid" else LINEAR_OPS) and fits.kernels == "triton"
        wide = performer(target, KERNEL_MAX_FEATURES + 1)
        assert wide.use_kernels("triton") == {} and wide.kernels is None


# -- the cells hand raw q, k, the map and the mask to the ops ---------------------------------

# (target, options): every map the ops apply themselves, one they lack (taylor: featurised here)
CELL_CASES = {
    "linear-elu": ("linear", {}),
    "linear-relu-unnormalised": ("linear", {"feature_map": "relu", "normalize": False}),
    "linear-hedgehog": ("linear", {"feature_map": "hedgehog"}),
    "linear-performer": ("linear", {"feature_map": "performer"}),
    "linear-taylor": ("linear", {"feature_map": "taylor"}),
    "gated-gla": ("gated", {"gate": "gla"}),
    "gated-retnet-performer": ("gated", {"gate": "retnet", "feature_map": "performer"}),
    "hybrid-hedgehog": ("hybrid", {"window": 3, "feature_map": "hedgehog", "memory_init": 0.5, "sinks": 0}),
    "hybrid-performer": ("hybrid", {"window": 3, "feature_map": "performer", "memory_init": 0.5, "sinks": 0}),
    "hybrid-sinks": ("hybrid", {"window": 2, "sinks": 2, "memory_init": 0.5, "feature_map": "elu"}),
}


def run_cell(cell, kernels, inputs):
    """A left-padded 5-token prefill then 2 decode steps; outputs and the gradients of q, k, v, x
    and the cell's parameters."""
    cell.use_kernels(kernels)
    q, k, v, x, mask = (t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs)
    state = cell.init_state(q.shape[0], q.device, q.dtype)
    extra = (lambda t: {"x": x[:, t]}) if cell.needs_input else (lambda t: {})
    outs = []
    for t in (slice(0, 5), slice(5, 6), slice(6, 7)):
        out, *state = cell(q[:, :, t], k[:, :, t], v[:, :, t], mask[:, t], *state, **extra(t))
        outs.append(out)
    out = torch.cat(outs, dim=2)
    leaves = [q, k, v, x] + [p for p in cell.parameters() if p.requires_grad]
    loss = (out * torch.linspace(-1, 1, out.shape[-1])).sum() + sum((s.float() ** 2).sum() for s in state[-2:])
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    return out.detach(), [g for g in grads if g is not None], [s.detach() for s in state]


@needs_triton
@pytest.mark.parametrize("case", list(CELL_CASES))
def test_cells_fused_match_their_own_forms(case, monkeypatch):
    """Fused (Triton through the interpreter, and the reference path) against the cell's PyTorch
    forms, with left padding: outputs, states and gradients (trainable maps and gates included)."""
    target, options = CELL_CASES[case]
    spec = CellSpec(4, 2, 8, 8, 8**-0.5, hidden_size=12)
    torch.manual_seed(0)
    cell = build_cell(target, spec, {"chunk_size": 4, **options})
    if target == "gated" and options["gate"] == "gla":
        torch.nn.init.normal_(cell.gate_up.weight, std=0.5)  # input-dependent gates
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, h, 7, 8, generator=gen) for h in (4, 2, 2))
    x = torch.randn(2, 7, 12, generator=gen)
    mask = torch.ones(2, 7, dtype=torch.bool)
    mask[0, :2] = False
    q, k, v = q.masked_fill(~mask[:, None, :, None], 9.0), k.masked_fill(~mask[:, None, :, None], 9.0), v
    calls = []
    for name in ("chunk_linear_attn", "fused_recurrent_linear_attn"):
        op = getattr(rnnify.kernels, name)
        monkeypatch.setattr(rnnify.kernels, name, lambda *a, _op=op, **kw: calls.append(kw) or _op(*a, **kw))
    expected = run_cell(cell, "none", (q, k, v, x, mask))
    assert not calls
    for kernels in ("reference", "triton"):
        out, grads, state = run_cell(cell, kernels, (q, k, v, x, mask))
        real = mask[:, None, :, None].expand_as(out)
        assert rel_diff(out[real], expected[0][real]) < 1e-5
        for a, b in zip(state, expected[2]):
            assert rel_diff(a.float(), b.float()) < 1e-5
        assert len(grads) == len(expected[1])
        for a, b in zip(grads, expected[1]):
            assert rel_diff(a, b) < 1e-5
    fused = options.get("feature_map", "elu")
    assert {kw["feature_map"] for kw in calls} == {"identity" if fused == "taylor" else fused}
    assert all(kw["mask"] is not None for kw in calls)


@pytest.mark.parametrize("target", ["linear", "gated", "hybrid", "aaren", "delta"])
def test_auto_without_triton_runs_the_faster_form_per_phase(target, monkeypatch):
    """kernels "auto" where Triton does not run: the phases a cell lists in
    ``own_forms_without_triton`` run its own PyTorch forms (no op is called), the others the ops'
    references; either way the outputs, states and gradients of kernels "none"."""
    monkeypatch.setattr(utils, "FORCE_TRITON", False)
    spec = CellSpec(4, 2, 8, 8, 8**-0.5, hidden_size=12)
    torch.manual_seed(0)
    options = {"window": 3, "memory_init": 0.5} if target == "hybrid" else {}
    cell = build_cell(target, spec, {"chunk_size": 4, **options})
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, h, 7, 8, generator=gen) for h in (4, 2, 2))
    inputs = (q, k, v, torch.randn(2, 7, 12, generator=gen), torch.ones(2, 7, dtype=torch.bool))
    calls = []
    for name in (
        "chunk_linear_attn",
        "fused_recurrent_linear_attn",
        "window_attn_step",
        "aaren_scan",
        "chunk_delta_rule",
        "fused_recurrent_delta_rule",
    ):
        op = getattr(rnnify.kernels, name)
        monkeypatch.setattr(rnnify.kernels, name, lambda *a, _op=op, _n=name, **kw: calls.append(_n) or _op(*a, **kw))
    expected = run_cell(cell, "none", inputs)
    assert not calls
    got = run_cell(cell, "auto", inputs)
    fused_phases = {"prefill", "decode"} - cell.own_forms_without_triton
    assert fused_phases == {"prefill"} if target in ("gated", "delta") else not fused_phases
    assert bool(calls) == bool(fused_phases)
    assert len(got[1]) == len(expected[1])
    for a, b in zip([got[0], *got[1], *got[2]], [expected[0], *expected[1], *expected[2]]):
        torch.testing.assert_close(a.float(), b.float(), rtol=1e-5, atol=1e-6)


# -- parity ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def converted(tiny_model_dir):
    cache = {}

    def get(family: str):
        if family not in cache:
            target, options = FAMILIES[family]
            model = rnnify.convert(tiny_model_dir("llama"), to=target, kernels="reference", **options)
            if target == "aaren":  # a learned query of its own, not zeros (uniform attention)
                vocab = model.manifest.vocab_size
                model.calibrate(torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(1)))
            cache[family] = model
        return cache[family]

    return get


def run_model(model, kernels: str, steps: int = 2) -> torch.Tensor:
    """Logits of a left-padded 2-row prefill, then ``steps`` decode steps."""
    model.use_kernels(kernels)
    ids = torch.randint(0, model.manifest.vocab_size, (2, 6 + steps), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[0, :2] = False
    return decode(model, ids, 6, mask)[0][:, 2:]  # row 0's padding positions excluded


@needs_triton
@pytest.mark.parametrize("family", list(FAMILIES))
def test_triton_matches_reference_and_the_cells_own_forms(family, converted):
    model = converted(family)
    assert model.manifest.cells[-1].kernels
    reference = run_model(model, "reference")
    assert torch.isfinite(reference).all()
    assert rel_diff(run_model(model, "triton"), reference) < 1e-5
    assert rel_diff(run_model(model, "none"), reference) < 1e-5


@needs_triton
@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_triton_matches_reference_over_chunks(family, tiny_model_dir):
    """Prompts over several chunks of the kernels (64 tokens; 16 with GLA's gate) and of the cells."""
    target, options = FAMILIES[family]
    chunk = {"block_size": 16} if target == "window" else {"chunk_size": 16}
    model = rnnify.convert(tiny_model_dir("llama"), to=target, kernels="reference", **options, **chunk)
    ids = torch.randint(0, model.manifest.vocab_size, (2, 108), generator=torch.Generator().manual_seed(2))
    results = {}
    for kernels in ("reference", "triton", "none"):
        model.use_kernels(kernels)
        results[kernels] = decode(model, ids, 100)[0]
    assert rel_diff(results["triton"], results["reference"]) < 1e-5
    assert rel_diff(results["none"], results["reference"]) < 1e-5


# -- manifest, load, CLI --------------------------------------------------------------------


@needs_triton
def test_manifest_round_trip_and_load_override(converted, tmp_path):
    model = converted("linear")
    model.use_kernels("reference")
    expected = run_model(model, "reference", steps=1)
    model.save(tmp_path / "m")
    manifest = json.loads((tmp_path / "m" / MANIFEST_FILE).read_text())
    assert manifest["kernels"] == "reference" and manifest["format_version"] == 3
    assert [cell["kernels"] for cell in manifest["cells"]] == [LINEAR_OPS, LINEAR_OPS]

    loaded = rnnify.load(tmp_path / "m")
    assert loaded.kernels == "reference" and {cell.kernels for cell in loaded.cells} == {"reference"}
    assert torch.equal(run_model(loaded, "reference", steps=1), expected)

    pinned = rnnify.load(tmp_path / "m", kernels="triton")
    assert pinned.kernels == "triton" and {cell.kernels for cell in pinned.cells} == {"triton"}
    assert rel_diff(run_model(pinned, "triton", steps=1), expected) < 1e-5
    pinned.save(tmp_path / "m2")
    assert json.loads((tmp_path / "m2" / MANIFEST_FILE).read_text())["kernels"] == "triton"


def test_format_1_manifest_loads_unfused(converted, tmp_path):
    converted("linear").save(tmp_path / "m")
    path = tmp_path / "m" / MANIFEST_FILE
    data = json.loads(path.read_text())
    del data["kernels"]
    for cell in data["cells"]:
        del cell["kernels"]
    path.write_text(json.dumps({**data, "format_version": 1}))
    model = rnnify.load(tmp_path / "m", verify=False)  # format 1 records no sha256 to check
    assert model.kernels == "none" and {cell.kernels for cell in model.cells} == {None}
    assert rnnify.load(tmp_path / "m", kernels="auto", verify=False).cells[0].kernels == "auto"


@needs_triton
def test_bad_kernels_are_user_errors(tiny_model_dir, converted, tmp_path, monkeypatch):
    with pytest.raises(rnnify.RnnifyError, match="unknown kernels 'gpu'"):
        rnnify.convert(tiny_model_dir("llama"), to="linear", kernels="gpu")
    converted("linear").save(tmp_path / "m")
    with pytest.raises(rnnify.RnnifyError, match="unknown kernels 'fast'"):
        rnnify.load(tmp_path / "m", kernels="fast")
    model = rnnify.load(tmp_path / "m", kernels="triton")
    monkeypatch.setattr(utils, "INTERPRET", False)  # as on a machine without a GPU or the interpreter
    with pytest.raises(rnnify.RnnifyError, match="kernels 'triton' run on CUDA, not cpu"):
        model.prefill(torch.tensor([[1, 2]]))


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@needs_triton
def test_cli_kernels_flag(capsys, tmp_path, tiny_model_dir):
    out_dir = tmp_path / "m"
    code, _, err = run_cli(
        capsys,
        "convert",
        tiny_model_dir("llama"),
        "--to",
        "window",
        "--window",
        "4",
        "--layers",
        "0:exact",
        "--kernels",
        "reference",
        "-o",
        out_dir,
        "--no-compile",
    )
    assert code == 0, err
    assert json.loads((out_dir / MANIFEST_FILE).read_text())["kernels"] == "reference"

    code, out, err = run_cli(capsys, "info", out_dir)
    assert code == 0, err
    assert "reference (the ops' PyTorch references); fused ops in 1 of 2 layers" in out
    assert "fused ops" in out and "decode window_attn_step" in out

    code, out, err = run_cli(
        capsys, "generate", out_dir, "--ids", "1,2,3", "--max-new-tokens", "2", "--kernels", "triton"
    )
    assert code == 0, err
    assert out.strip().startswith("1,2,3,")
    code, out, err = run_cli(capsys, "verify", out_dir, "--tokens", "6", "--batch", "1", "--kernels", "triton")
    assert code == 0, out + err

    for argv in (
        ["convert", tiny_model_dir("llama"), "--to", "linear", "--kernels", "cuda", "-o", tmp_path / "x"],
        ["generate", out_dir, "--ids", "1", "--kernels", "fast"],
    ):
        code, _, err = run_cli(capsys, *argv)
        assert code == 2 and "invalid choice" in err and "Traceback" not in err
    assert not (tmp_path / "x").exists()


@needs_triton
def test_a_model_pinned_to_triton_compiles_its_step_on_a_cpu(capsys, tmp_path, converted, monkeypatch, empty_cache):
    """The step is compiled and checked from the cells' own forms, whatever kernels the model names."""
    model = converted("linear")
    model.use_kernels("triton")
    model.save(tmp_path / "m")
    monkeypatch.setattr(utils, "INTERPRET", False)  # as on a machine without a GPU or the interpreter
    code, _, err = run_cli(capsys, "compile", tmp_path / "m")
    assert code == 0, err
    assert rnnify.load(tmp_path / "m", kernels="auto").step_package is not None


@needs_triton
def test_cli_pinned_triton_without_a_gpu_is_a_user_error(capsys, tmp_path, converted, monkeypatch):
    model = converted("linear")
    model.use_kernels("triton")
    model.save(tmp_path / "m")
    monkeypatch.setattr(utils, "INTERPRET", False)
    code, out, err = run_cli(capsys, "info", tmp_path / "m")  # inspecting needs no GPU
    assert code == 0 and "triton; fused ops in 2 of 2 layers" in out
    for command in (["generate", tmp_path / "m", "--ids", "1,2"], ["chat", tmp_path / "m"]):
        code, out, err = run_cli(capsys, *command)
        assert code == 2 and err.startswith("error: kernels 'triton' run on CUDA") and "Traceback" not in err
        assert out == ""  # refused before the prompt is printed
