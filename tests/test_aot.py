"""The decode step compiled ahead of time (``rnnify compile``, ``rnnify.runtime.aot``): the same
numbers as the eager step, at any batch size, and never used for a model it was not compiled for.
Where the compiled steps are kept, and what a directory may ship, is tests/test_step_cache.py's."""

import os
import shutil
from pathlib import Path

import pytest
import torch

import rnnify
from rnnify.cli import main
from rnnify.errors import RnnifyWarning
from rnnify.runtime.aot import STEP_PACKAGE, StepPackage, fingerprint
from rnnify.runtime.step_cache import cached


def _decode(model, batch: int, prompt: int, steps: int = 4, ids: torch.dtype = torch.long):
    """Logits of ``steps`` one-token calls after a ``prompt``-token prompt (0: from the empty state)."""
    ids = (torch.arange(1, batch * (prompt + steps) + 1).reshape(batch, -1) % 50).to(ids)
    state = model.init_state(batch)
    if prompt:
        _, state = model.prefill(ids[:, :prompt])
    logits = []
    for t in range(prompt, prompt + steps):
        out, state = model.step(ids[:, t : t + 1], state)
        logits.append(out)
    return torch.cat(logits, 1), state


@pytest.mark.parametrize("target", ["hybrid", "exact"])  # a constant state, and one that grows every step
def test_compiled_step_matches_the_eager_step(compiled, target, monkeypatch):
    path = compiled(target)
    aot, eager = rnnify.load(path), rnnify.load(path, aot_step=False)
    assert aot.step_package is not None and eager.step_package is None
    calls = []
    run = StepPackage.__call__
    monkeypatch.setattr(StepPackage, "__call__", lambda self, *inputs: calls.append(1) or run(self, *inputs))
    for batch, prompt, ids in [(1, 5, torch.long), (3, 2, torch.long), (2, 0, torch.long), (2, 3, torch.int32)]:
        want, want_state = _decode(eager, batch, prompt, ids=ids)
        got, got_state = _decode(aot, batch, prompt, ids=ids)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        for a, b in zip(got_state.tensors, want_state.tensors):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    # every one-token call ran the package, but the first at a shape the load's runs did not meet (3
    # rows; int32 ids), which runs node by node under the bounds of a new shape (``runtime.new_shapes``)
    assert len(calls) == 4 * 4 - 2


@pytest.mark.parametrize(
    "target",
    [["window"], pytest.param(["select", "--option", "keep=4", "--option", "chunk=4"], marks=pytest.mark.slow)],
)
def test_an_int8_cache_keeps_its_compiled_step(tiny_model_dir, tmp_path, monkeypatch, target):
    """A window or a selection cache storing int8 slots (``--kv-dtype int8``) compiles, the compile's
    check compares its slots as the values they hold at their rounding (``agreement.rounding_dtype``)
    and keeps the package, and the package decodes as the eager step does."""
    from rnnify.runtime.agreement import relative_difference, rounding_dtype, tolerance

    monkeypatch.setenv("RNNIFY_CACHE", os.environ["RNNIFY_TEST_CACHE"])
    out = tmp_path / "model"
    argv = ["convert", str(tiny_model_dir("llama")), "--to", *target, "--window", "4", "--kv-dtype", "int8"]
    assert main([*argv, "-o", str(out), "--threads", "1"]) == 0
    aot, eager = rnnify.load(out), rnnify.load(out, aot_step=False)
    assert aot.step_package is not None
    (got, _), (want, _) = _decode(aot, 2, 5), _decode(eager, 2, 5)
    assert relative_difference(got, want) < tolerance(rounding_dtype(aot))


def test_compiled_step_follows_weights_changed_in_place_and_stops_when_they_are_replaced(compiled):
    model = rnnify.load(compiled("hybrid"))
    weight = model.graph.get_parameter("lm_head.weight")
    with torch.no_grad():
        weight.mul_(2)  # in place: the package reads the model's own tensors
    got, _ = _decode(model, 1, 3)
    eager = rnnify.load(compiled("hybrid"), aot_step=False)
    with torch.no_grad():
        eager.graph.get_parameter("lm_head.weight").mul_(2)
    torch.testing.assert_close(got, _decode(eager, 1, 3)[0], rtol=1e-4, atol=1e-4)
    model.graph.lm_head.weight = torch.nn.Parameter(weight.detach().clone())  # replaced: the package no longer serves
    assert model.step_package is None
    torch.testing.assert_close(_decode(model, 1, 3)[0], _decode(eager, 1, 3)[0], rtol=1e-5, atol=1e-5)


def test_a_step_compiled_from_other_source_is_not_found(compiled, monkeypatch, capsys):
    """A step compiled before rnnify's source changed (a fixed cell, the same version number; an
    upgrade) has another key: the cache does not hand back code that is not the running code's. The
    load says, in one warning line, why it decodes eagerly and what compiles the step again, and
    ``rnnify info`` says the same."""
    from rnnify.runtime import aot

    hybrid = rnnify.load(compiled("hybrid"))
    assert hybrid.step_package is not None
    key = fingerprint(hybrid)
    monkeypatch.setattr(aot, "_source_digest", lambda: "another source")
    assert fingerprint(hybrid) != key
    with pytest.warns(RnnifyWarning, match=r"for another rnnify, torch or CPU.*`rnnify compile .*` compiles it again"):
        assert rnnify.load(compiled("hybrid")).step_package is None
    capsys.readouterr()
    assert main(["info", str(compiled("hybrid"))]) == 0
    out = " ".join(capsys.readouterr().out.split())  # as the table wraps it
    assert "eager: this machine compiled its decode step for another rnnify, torch or CPU" in out


@pytest.mark.parametrize("other", ["linear", "hybrid-w8"])
def test_a_step_compiled_for_another_model_is_not_found(
    compiled, converted_dir, tiny_model_dir, tmp_path, other, empty_cache
):
    """The cache is keyed by what a step was compiled for: another target, or the same graph code and
    weights with another window (the compiled code has the old state shapes), finds nothing."""
    hybrid = rnnify.load(compiled("hybrid"))
    entry = Path(os.environ["RNNIFY_TEST_CACHE"]) / "steps" / fingerprint(hybrid) / STEP_PACKAGE  # the session's
    if other == "linear":
        path = converted_dir("llama", "linear")
    else:
        path = tmp_path / "hybrid-w8"
        rnnify.convert(tiny_model_dir("llama"), to="hybrid", window=8).save(path)
    model = rnnify.load(path, aot_step=False)
    assert fingerprint(model) != fingerprint(hybrid)
    key = empty_cache / "steps" / fingerprint(hybrid)
    key.mkdir(parents=True, mode=0o700)
    shutil.copy(entry, key / STEP_PACKAGE)  # only the hybrid's step in this cache
    assert rnnify.load(compiled("hybrid")).step_package is not None
    assert cached(model) is None and rnnify.load(path).step_package is None


def test_compile_refuses_a_cache_that_grows_up_to_a_sliding_window(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "mistral-exact"
    rnnify.convert(tiny_model_dir("mistral"), to="exact").save(out)
    assert main(["compile", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and len(err.strip().splitlines()) == 1 and "sliding window" in err
    assert not (out / STEP_PACKAGE).exists()


def test_a_copied_model_decodes_eagerly(compiled):
    import copy

    model = copy.deepcopy(rnnify.load(compiled("hybrid")))
    assert model.step_package is None
    model.step(torch.tensor([[3]]), model.init_state(1))


def test_info_says_how_the_step_runs(compiled, capsys, monkeypatch, tmp_path):
    assert main(["info", str(compiled("hybrid"))]) == 0
    assert "compiled ahead of time (this machine's cache:" in " ".join(capsys.readouterr().out.split())
    monkeypatch.setenv("RNNIFY_CACHE", str(tmp_path / "empty"))  # another machine's
    assert main(["info", str(compiled("hybrid"))]) == 0
    assert "eager (rnnify compile DIR" in capsys.readouterr().out


def test_compile_of_a_missing_directory_exits_2(tmp_path, capsys):
    assert main(["compile", str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and len(err.strip().splitlines()) == 1


def test_a_failing_compiler_is_one_error_line_and_leaves_nothing(
    converted_dir, tmp_path, capsys, monkeypatch, empty_cache
):
    out = tmp_path / "model"
    shutil.copytree(converted_dir("llama", "linear"), out)
    before = sorted(p.name for p in out.iterdir())

    def no_compiler(*args, **kwargs):
        from torch._inductor.exc import CppCompileError

        raise CppCompileError(["g++", "step.cpp"], "g++: command not found")

    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", no_compiler)
    assert main(["compile", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and len(err.strip().splitlines()) == 1 and "C++ compiler" in err
    assert sorted(p.name for p in out.iterdir()) == before
    assert [p for p in empty_cache.rglob("*") if p.is_file()] == []  # no scratch left in the cache


def test_a_compiled_step_that_parts_from_the_eager_step_is_not_kept(
    converted_dir, tmp_path, capsys, monkeypatch, empty_cache
):
    """A compiler can be wrong: a package whose step gives other logits than the graph's own is
    refused before it reaches the cache (one error line, nothing kept), and the model decodes eagerly."""
    out = tmp_path / "model"
    shutil.copytree(converted_dir("llama", "linear"), out)
    run = StepPackage.__call__

    def miscompiled(self, *inputs):
        logits, *state = run(self, *inputs)
        return [logits * 1.01, *state]

    monkeypatch.setattr(StepPackage, "__call__", miscompiled)
    assert main(["compile", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: the compiled step was not kept: its logits after 6 tokens differ")
    assert len(err.strip().splitlines()) == 1
    assert [p for p in empty_cache.rglob("*") if p.is_file()] == []
    assert rnnify.load(out).step_package is None


@pytest.mark.slow
def test_a_head_split_step_compiled_on_one_thread_decodes_as_the_eager_step(tmp_path, capsys, empty_cache):
    """torch 2.13's AOTInductor, generating loops for a fixed thread count (the compiling process's:
    one at --threads 1), gave a step whose logits part from the graph's for a head split with its
    first kv head's window apart from the rest's (head_dim 64, 3 query heads a kv head): the step is
    compiled with loops that take their thread count when they run, kept, and decodes as the eager
    step."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256, hidden_size=576, intermediate_size=64, num_hidden_layers=1, num_attention_heads=9,
        num_key_value_heads=3, head_dim=64, max_position_embeddings=2048,
    )  # fmt: skip
    source = LlamaForCausalLM(config).eval()
    model = rnnify.convert(source, to="window", window=256, sinks=4, layers="0:heads(0=window(window=1024))")
    model.save(tmp_path / "model")
    assert main(["compile", str(tmp_path / "model"), "--threads", "1"]) == 0, capsys.readouterr().err
    aot, eager = rnnify.load(tmp_path / "model"), rnnify.load(tmp_path / "model", aot_step=False)
    assert aot.step_package is not None
    for batch, prompt in [(1, 5), (2, 20)]:
        want, _ = _decode(eager, batch, prompt)
        got, _ = _decode(aot, batch, prompt)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_convert_compiles_the_step_unless_told_not_to(compiled, tiny_model_dir, tmp_path, capsys, empty_cache):
    capsys.readouterr()  # what building the fixture printed, if this test built it
    out = tmp_path / "eager"
    assert main(["convert", str(tiny_model_dir("llama")), "--to", "hybrid", "-o", str(out), "--no-compile"]) == 0
    assert "decode step" not in capsys.readouterr().out and not (out / STEP_PACKAGE).exists()
    assert not empty_cache.exists() and rnnify.load(out).step_package is None


def test_a_window_without_sinks_compiles_its_step(tiny_model_dir, tmp_path, capsys, empty_cache):
    """A window without sinks carries empty sink buffers in its state: the check that the compiled
    step decodes as the eager one finds them agreeing (it failed on them, and the step stayed eager
    with a warning), and the compiled step is used."""
    out = tmp_path / "window"
    argv = [
        "convert",
        str(tiny_model_dir("llama")),
        "--to",
        "window",
        "--window",
        "8",
        "-o",
        str(out),
        "--threads",
        "1",
    ]
    assert main(argv) == 0
    assert "warning" not in capsys.readouterr().err
    aot, eager = rnnify.load(out), rnnify.load(out, aot_step=False)
    assert aot.step_package is not None and any(t.numel() == 0 for t in aot.init_state(1).tensors)
    want, _ = _decode(eager, 2, 3, steps=10)  # past the window
    got, _ = _decode(aot, 2, 3, steps=10)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_convert_with_a_failing_compiler_warns_and_saves_the_whole_model(
    tiny_model_dir, tmp_path, capsys, monkeypatch, empty_cache
):
    def no_compiler(*args, **kwargs):
        from torch._inductor.exc import CppCompileError

        raise CppCompileError(["g++", "step.cpp"], "g++: command not found")

    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", no_compiler)
    out = tmp_path / "model"
    assert main(["convert", str(tiny_model_dir("llama")), "--to", "linear", "-o", str(out)]) == 0
    captured = capsys.readouterr()
    assert "decode step: eager" in captured.out and "C++ compiler" in captured.err and "rnnify compile" in captured.err
    assert "Traceback" not in captured.err
    assert not (out / STEP_PACKAGE).exists()
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no scratch left behind
    assert [p for p in empty_cache.rglob("*") if p.is_file()] == []
    assert rnnify.load(out).step_package is None


def test_convert_leaves_a_large_models_step_eager_unless_told_to_compile(
    tiny_model_dir, tmp_path, capsys, monkeypatch, empty_cache
):
    """A step that reads more weights than aot.WORTH_COMPILING_BELOW is mostly those reads: not compiled
    by default (here the bound is lowered under the tiny model's weights and the compile recorded)."""
    import rnnify.runtime.aot as aot
    import rnnify.runtime.step_cache as step_cache

    compiles = []
    monkeypatch.setattr(aot, "WORTH_COMPILING_BELOW", 1024)
    monkeypatch.setattr(step_cache, "compile_into_cache", lambda model: compiles.append(model) or empty_cache)
    model = tiny_model_dir("llama")
    assert main(["convert", str(model), "--to", "linear", "-o", str(tmp_path / "default")]) == 0
    printed = capsys.readouterr().out
    assert "decode step: eager (a step reads" in printed and "--compile compiles it anyway" in printed and not compiles
    assert main(["convert", str(model), "--to", "linear", "-o", str(tmp_path / "forced"), "--compile"]) == 0
    assert len(compiles) == 1
    assert "decode step: compiled ahead of time" in capsys.readouterr().out


def test_convert_of_a_sliding_window_exact_model_says_its_step_stays_eager(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "mistral-exact"
    assert main(["convert", str(tiny_model_dir("mistral")), "--to", "exact", "-o", str(out)]) == 0
    assert "decode step: eager (" in capsys.readouterr().out and not (out / STEP_PACKAGE).exists()


@pytest.mark.parametrize("case", ["copy", "large", "in place"])
def test_distill_finds_the_step_its_model_was_compiled_with(compiled, tmp_path, capsys, monkeypatch, case):
    """A distilled copy has the same graph and weight shapes: it finds its source's step in this
    machine's cache, not compiled again, and that step computes the distilled weights' logits; found
    too for a model large enough that it would not be compiled by default (finding costs nothing), and
    when the model is distilled in place (-o its own directory, which saving replaces)."""
    import rnnify.runtime.aot as aot
    import rnnify.runtime.step_cache as step_cache

    source_dir = compiled("hybrid")  # built (and compiled) before compiling is made to fail
    monkeypatch.setattr(step_cache, "compile_into_cache", lambda *a, **k: pytest.fail("compiled again"))
    if case == "large":
        monkeypatch.setattr(aot, "WORTH_COMPILING_BELOW", 1024)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("def main(argv):\n    for arg in argv:\n        print(arg.upper(), len(arg))\n" * 8)
    out = tmp_path / "distilled"
    if case == "in place":  # a copy of the shared fixture, distilled into itself
        shutil.copytree(source_dir, out)
    given = out if case == "in place" else source_dir
    argv = [
        "distill",
        str(given),
        "--data",
        str(corpus),
        "-o",
        str(out),
        "--seq-len",
        "96",  # past the hybrid's window and sinks, 68: shorter rows teach its memory nothing
        "--batch-size",
        "2",
        "--max-tokens",
        "192",
        "--stages",
        "transfer",
        "--lr",
        "0.5",
        "--threads",
        "1",
        "--device",
        "cpu",
        *(["--overwrite"] if case == "in place" else []),
    ]
    capsys.readouterr()
    assert main(argv) == 0, capsys.readouterr().err
    assert "found in this machine's cache" in capsys.readouterr().out
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no scratch left behind
    assert not (out / STEP_PACKAGE).exists()
    distilled, source = rnnify.load(out), rnnify.load(source_dir)
    assert distilled.step_package is not None
    changed = [
        name for name, t in distilled.graph.named_parameters() if not torch.equal(t, source.graph.get_parameter(name))
    ]
    assert changed  # the step below runs other weights than the step was compiled beside
    want, _ = _decode(rnnify.load(out, aot_step=False), 2, 3)
    torch.testing.assert_close(_decode(distilled, 2, 3)[0], want, rtol=1e-4, atol=1e-4)


def test_verify_checks_the_compiled_step(compiled, capsys):
    assert main(["verify", str(compiled("hybrid")), "--tokens", "12"]) == 0
    out = capsys.readouterr().out
    assert "step compiled ahead of time" in out and "all checks passed" in out


def test_eager_step_decodes_without_the_compiled_step(compiled, capsys, monkeypatch):
    """--eager-step on every command that decodes: the compiled step is never called (here it fails)."""
    from rnnify.runtime.aot import StepPackage

    directory = str(compiled("hybrid"))
    assert main(["verify", directory, "--tokens", "12", "--eager-step"]) == 0
    out = capsys.readouterr().out
    assert "step compiled ahead of time" not in out and "all checks passed" in out

    def broken(self, *inputs):
        raise RuntimeError("the compiled step ran")

    monkeypatch.setattr(StepPackage, "__call__", broken)
    generate = ["generate", directory, "--ids", "1,2,3", "--max-new-tokens", "3"]
    assert main(generate) == 2
    assert "its step failed: RuntimeError: the compiled step ran" in capsys.readouterr().err
    assert main([*generate, "--eager-step"]) == 0
    want = rnnify.load(directory, aot_step=False).generate(torch.tensor([[1, 2, 3]]), 3)
    assert capsys.readouterr().out.strip().startswith(",".join(map(str, want[0, :4].tolist())))
    assert main([*generate, "--eager-step", "--trust-compiled-step"]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: --eager-step runs no compiled step: it cannot go with --trust-compiled-step"
    )


def test_distill_of_a_model_trained_elsewhere_compiles_from_the_saved_copy(
    compiled, tmp_path, monkeypatch, empty_cache
):
    """A model distilled on another device is compiled from its saved directory, loaded on the CPU
    (the step is for CPUs); here the device is faked and the compile recorded."""
    import rnnify.runtime.step_cache as step_cache
    from rnnify.cli.compile import compile_step

    out = tmp_path / "model"
    shutil.copytree(compiled("hybrid"), out)
    trained = rnnify.load(out)
    trained.__class__ = type("OnAGpu", (type(trained),), {"device": property(lambda self: torch.device("cuda", 0))})
    compiled_models = []
    monkeypatch.setattr(step_cache, "compile_into_cache", lambda model: compiled_models.append(model) or empty_cache)
    assert (
        compile_step(trained, out) == f"decode step: compiled ahead of time (into this machine's cache: {empty_cache})"
    )
    [model] = compiled_models
    assert model is not trained and model.path == out
