"""The probe for models whose attention transformers' attention interface does not reach.

BLOOM, MPT, GPT-Neo, XGLM and other older models compute attention in their own code, which
``rnnify.auto.probe`` cannot replace. The compiler finds their attention all the same (it matches
the eager pattern in the captured graph, score terms included), so here the model is converted to
``exact`` (which checks itself against the original) and each exact cell of that graph is swapped
for a ``ProbeCell``: it attends with the site's own window and score terms through the probe, each
kv head as the probe's kind. A forward pass of that graph is then the probe's pass. It runs every
layer each time (no replay of the layers before a windowed head), so scoring is slower than on
the interface.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

import torch

from rnnify.auto.probe import InterfaceRunner, NoInterfaceError, _Probe, sites_per_layer
from rnnify.cells.base import CellSpec
from rnnify.cells.exact import ExactCell
from rnnify.compiler.composite import language_model
from rnnify.compiler.passes.find_attention import config_chunk
from rnnify.compiler.passes.find_selection import indexer_modules
from rnnify.errors import RnnifyError


class ProbeCell(ExactCell):
    """Stands in for an exact cell of layer ``layer`` (``spec``): each prefill attends through the
    probe installed (``probe``), with the causal mask, the site's own sliding window, ALiBi's
    ``slope_h (j - i)``, the softcap and the sink logits; the (empty) state passes through."""

    def __init__(self, spec: CellSpec, layer: int):
        super().__init__(spec)
        self.layer, self.probe = layer, None

    def forward(self, q, k, v, mask, *state):
        length, device, terms = q.shape[2], q.device, self.terms  # ScoreTerms: the spec's slopes and sinks
        i = torch.arange(length, device=device)[:, None]
        j = torch.arange(length, device=device)[None, :]
        allowed = j <= i
        if self.spec.window is not None:
            allowed = allowed & (i - j < self.spec.window)
        if self.spec.chunk is not None:  # a probe row has no padding: its chunks count from 0
            allowed = allowed & (i // self.spec.chunk == j // self.spec.chunk)
        slopes = None if terms is None else terms.slopes  # [Hkv, G, 1, 1]
        sinks = None if terms is None else terms.sinks  # [Hkv, G, 1]
        bias = None if slopes is None else slopes.reshape(1, -1, 1, 1) * (j - i).float()
        sinks = None if sinks is None else sinks.reshape(-1)
        out = self.probe.attend(
            self.layer, q, k, v, allowed, bias, self.spec.scale, self.spec.softcap, sinks, self.spec.window
        )
        return (out.to(q.dtype), *state)


class GraphRunner:
    """Runs ``source`` converted to ``exact``, each exact cell a ``ProbeCell``: ``probed`` installs a
    probe, ``logits`` reads a row, ``specs`` are the compiler's sites by layer."""

    layers = None  # nothing to replay: the graph runs whole

    def __init__(self, source: torch.nn.Module, dtype: torch.dtype):
        from rnnify.compiler.convert import convert

        self.model = convert(source, to="exact", dtype=dtype, kernels="none")
        entries = [entry for entry in self.model.manifest.cells if entry.target == "exact"]
        shape = ("num_heads", "num_kv_heads", "head_dim", "value_dim")
        self.sites = sites_per_layer([(entry.layer, tuple(entry.spec[key] for key in shape)) for entry in entries])
        self.cells = []
        for entry in entries:
            exact = self.model.graph.get_submodule(entry.module)
            if exact.spec.per_query_terms:
                raise RnnifyError(
                    f"--to auto: layer {entry.layer} adds to its scores terms each query brings (a relative bias "
                    "or sink logits), which no kind --to auto chooses carries; convert with --to exact"
                )
            cell = ProbeCell(exact.spec, entry.layer).to(self.model.device)
            self.model.graph.set_submodule(entry.module, cell)
            self.cells.append(cell)

    @contextmanager
    def probed(self, probe: _Probe) -> Iterator[_Probe]:
        for cell in self.cells:
            cell.probe = probe
        try:
            yield probe
        finally:
            for cell in self.cells:
                cell.probe = None

    @torch.no_grad()
    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.prefill(ids.to(self.model.device))[0][0].float()

    def specs(self, ids: torch.Tensor) -> dict[int, CellSpec]:
        return {cell.layer: cell.spec for cell in sorted(self.cells, key=lambda cell: cell.layer)}


def probe_runner(source: torch.nn.Module, dtype: torch.dtype, ids: torch.Tensor):
    """The runner that scores ``source``'s heads and its attention layers' sites: through
    transformers' attention interface where its attention goes through it (``InterfaceRunner``),
    else through its exact conversion (``GraphRunner``). A composite model is scored by its language
    model, which is what converting it converts (``rnnify.compiler.composite``). A layer the config
    gives chunked attention (Llama 4's) has the chunk in its spec: only ``exact`` computes it, so
    ``--to auto`` keeps it exact (``HeadScorer``). A model with sparse attention (an indexer) is
    refused: no runner scores its heads with their selection."""
    source = language_model(source)
    indexers = indexer_modules(source)
    if indexers:
        raise RnnifyError(
            f"--to auto does not score sparse attention yet ({indexers[0]}: an indexer chooses the keys each "
            "query reads); convert with --to exact"
        )
    runner = InterfaceRunner(source)
    try:
        specs = runner.specs(ids)
    except NoInterfaceError:
        runner = GraphRunner(source, dtype)
        specs = runner.specs(ids)
    chunks = {layer: config_chunk(source.config, layer) for layer in specs}
    return runner, {layer: replace(spec, chunk=chunks[layer]) for layer, spec in specs.items()}


@torch.no_grad()
def attention_specs(source, ids: torch.Tensor) -> dict[int, CellSpec]:
    """Each attention layer's ``CellSpec`` (by decoder layer), recorded on one forward pass of ``ids``
    of ``source`` (a Hugging Face model, probed as ``probe_runner`` chooses, or a runner): the
    layers a hybrid model mixes with recurrent layers of its own are not among them, and each
    carries its own sliding window and score terms, as the compiler finds the sites."""
    if hasattr(source, "probed"):
        return source.specs(ids)
    return probe_runner(source, next(source.parameters()).dtype, ids)[1]
