"""Converting and saving hold one copy of the weights: the source model's.

Capture shares the source's tensors rather than copying them, and saving streams them to disk
from their own memory; ``benchmarks/convert_memory.py`` measures what this means for the peak
RSS of a 1B-parameter conversion.
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

import rnnify
from rnnify.runtime import weights_file


def _storages(module: torch.nn.Module) -> set[int]:
    """Its parameters' and buffers' memory, non-persistent buffers (rotary tables) included."""
    return {t.untyped_storage().data_ptr() for t in [*module.parameters(), *module.buffers()]}


def _bytes(module: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in {id(t): t for t in module.state_dict().values()}.values())


def _peak_allocated_bytes(fn) -> int:
    """The most bytes torch ops held from the CPU allocator at once while ``fn`` ran, per torch.profiler."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    held = peak = 0
    for event in sorted(prof.events(), key=lambda event: event.time_range.start):
        held += event.self_cpu_memory_usage
        peak = max(peak, held)
    return peak


def test_converted_graph_shares_the_source_weights(tiny_model_dir):
    source = AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama"))
    model = rnnify.convert(source, to="linear")
    cells = tuple(entry.module + "." for entry in model.manifest.cells)
    captured = {name: t for name, t in model.graph.state_dict().items() if not name.startswith(cells)}
    assert "model.embed_tokens.weight" in captured and len(captured) > 10
    memory = _storages(source)
    unshared = [name for name, t in captured.items() if t.untyped_storage().data_ptr() not in memory]
    assert unshared == []


def test_save_writes_the_weights_without_copying_them(tiny_model_dir, tmp_path, monkeypatch):
    """Row-major weights go out from their own memory, column-major ones (float32 linear weights on a
    CPU, ``runtime.weight_layout``) a block of rows at a time: a small block here, so that a whole
    copy of any weight would show."""
    monkeypatch.setattr(weights_file, "_BLOCK_BYTES", 1024)
    model = rnnify.convert(tiny_model_dir("llama"), to="linear")
    weights = _bytes(model.graph)
    assert any(t.dim() == 2 and not t.is_contiguous() for t in model.graph.parameters())
    allocated = _peak_allocated_bytes(lambda: model.save(tmp_path / "out"))
    assert allocated < weights / 20, (allocated, weights)
    saved, reloaded = model.graph.state_dict(), rnnify.load(tmp_path / "out").graph.state_dict()
    assert sorted(reloaded) == sorted(saved)
    assert [name for name, tensor in saved.items() if not torch.equal(reloaded[name], tensor)] == []
