"""The interface every recurrent cell implements.

A cell replaces one attention site. The graph calls it as

    out, *new_state = cell(q, k, v, mask, *state)

with q ``[B, num_heads, T, head_dim]``, k/v ``[B, num_kv_heads, T, dim]`` (one state per kv
head), ``mask`` ``[B, T]`` (True for real tokens, False for left padding) and ``out`` shaped like
the SDPA output it replaces. T is 1 for a decode step and any length for a prefill that continues
from ``state``. The state is functional: a cell never mutates its inputs.

A cell with a fused form names the ``rnnify.kernels`` ops it runs (``fused_ops``); after
``use_kernels(backend)`` (the ``fuse_kernels`` pass, or ``rnnify.load(..., kernels=...)``) its
forward calls them instead of its own PyTorch forms, on the same state; ``use_kernels("none")``
switches back.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from rnnify.errors import check_int, is_number, is_positive_finite
from rnnify.kernels.utils import check_kernels, resolve_backend


def host_readable(x: torch.Tensor) -> bool:
    """May a cell read ``x``'s values on the host to skip ops? Only eager on a CPU: a compiled,
    exported or traced graph keeps the ops for every value, and on CUDA a host read would wait for
    the device."""
    compiled = torch.compiler.is_compiling() or torch.jit.is_tracing() or isinstance(x, FakeTensor)
    return x.device.type == "cpu" and not compiled


def every_token_real(mask: torch.Tensor) -> bool:
    """True when ``mask [B, T]`` holds no padding, read on the host where that is cheap
    (``host_readable``; elsewhere False). A decode step's mask is read with no op at all, a prompt's
    with one reduction. Then a cell can skip zeroing padding."""
    if not host_readable(mask):
        return False
    if mask.shape[-1] == 1:
        return all(row[0] for row in mask.tolist())
    return bool(mask.all())


def channel_spec(channels: int) -> CellSpec:
    """The spec of a model's own layer over ``channels`` channels that never mix (a short convolution, an
    RG-LRU, a token shift), in attention's terms: each channel a head of width 1, so ``num_heads`` =
    ``num_kv_heads`` = C and ``head_dim`` = ``value_dim`` = 1; ``scale`` is unused."""
    return CellSpec(num_heads=channels, num_kv_heads=channels, head_dim=1, value_dim=1, scale=1.0)


def zero_fp32_state(batch_size: int, *shape: int, device) -> tuple[torch.Tensor]:
    """The one state tensor of a model's own recurrent layer before any token: zeros in fp32 whatever
    the weights' dtype, as the sources run their recurrences in fp32."""
    return (torch.zeros(batch_size, *shape, device=device, dtype=torch.float32),)


# What a model adds to the scores s = scale q . k of its softmax attention, by CellSpec field, as
# messages name it (docs/math.md §Score terms)
SCORE_TERMS = {
    "softcap": "logit softcapping",
    "alibi_slopes": "ALiBi position bias",
    "sink_logits": "learned attention sinks",
    "relative_extent": "relative position bias per query",
    "query_sinks": "attention sinks per query",
}
# the SCORE_TERMS each query brings as an input of the cell's call (only ``exact`` takes them)
PER_QUERY_TERMS = frozenset({"relative_extent", "query_sinks"})


# CellSpec fields that a manifest holds only where the site has them
_OPTIONAL = (*SCORE_TERMS, "chunk", "index_topk", "index_dim", "index_scale", "index_block", "index_pool", "index_eps")


@dataclass(frozen=True)
class CellSpec:
    """Shape and scale of the attention site a cell replaces, and the terms its scores carry
    (``SCORE_TERMS``, in the order the model applies them): ``softcap`` c makes a score
    c tanh(s / c) (Gemma 2), ``alibi_slopes`` add slope_h (j - i) for key j and query i, counted in
    real tokens (ALiBi), and ``sink_logits`` add exp(sink_h) to each softmax denominator (gpt-oss),
    all per query head; with ``relative_extent`` E, each query i brings its own bias r_i[d] for the
    keys at distances d = i - j < E (Inkling's, a cell input ``relative``), and with ``query_sinks``
    its own sink logit (Inkling 2's, a cell input ``sinks``). A cell computes them only where its
    class lists them in ``Cell.score_terms``."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    value_dim: int
    scale: float
    window: int | None = None  # the model's own sliding window, if it has one
    hidden_size: int | None = None  # width of the layer input x (for cells with needs_input)
    softcap: float | None = None
    alibi_slopes: tuple[float, ...] | None = None
    sink_logits: tuple[float, ...] | None = None
    relative_extent: int | None = None
    query_sinks: bool | None = None  # True or None (a manifest holds it only where True)
    # the model's own chunked attention (Llama 4's): a query reads the earlier keys of its own chunk
    chunk: int | None = None
    # the model's sparse attention (DeepSeek-V3.2's indexer, docs/math.md §Indexer selection): a query
    # reads only the index_topk earlier keys whose index scores sum_h w_h relu(index_scale q_h . k) are
    # highest, over index keys index_dim wide. With index_block r it ranks pools of r keys instead and
    # reads the index_topk // r ranked highest and its unfinished pool, a pool's key made as
    # index_pool says: "mean" (Qwen4-Exp's QSA: RMS-normed with index_eps and rotated, scored
    # sum_h relu(q_h . K) / sqrt(d), no index_scale) or "gated" (GLM-5-Next's: a softmax-gated sum,
    # scored as the keys are)
    index_topk: int | None = None
    index_dim: int | None = None
    index_scale: float | None = None
    index_block: int | None = None
    index_pool: str | None = None
    index_eps: float | None = None

    def __post_init__(self) -> None:
        # a spec read from a manifest is data: sizes that no attention has fail here, by name
        for name in ("num_heads", "num_kv_heads", "head_dim", "value_dim"):
            check_int(name, getattr(self, name))
        for name in ("window", "hidden_size", "chunk", "index_topk", "index_dim", "index_block", "relative_extent"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name))
        if self.window is not None and self.chunk is not None:
            raise ValueError("an attention has a sliding window or chunks, not both")
        index = (self.index_topk, self.index_dim, self.index_scale, self.index_block, self.index_pool, self.index_eps)
        if any(field is not None for field in index):
            self._check_indexer()
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if not is_positive_finite(self.scale):
            raise ValueError(f"scale must be a positive number, got {self.scale!r}")
        if self.query_sinks is not None and self.query_sinks is not True:
            raise ValueError(f"query_sinks must be true or absent, got {self.query_sinks!r}")
        if self.query_sinks and self.sink_logits is not None:
            raise ValueError("an attention has sink logits per head or per query, not both")
        if self.softcap is not None and not is_positive_finite(self.softcap):
            raise ValueError(f"softcap must be a positive number, got {self.softcap!r}")
        for name in ("alibi_slopes", "sink_logits"):
            values = getattr(self, name)
            if values is None:
                continue
            if not (
                isinstance(values, (list, tuple))
                and len(values) == self.num_heads
                and all(is_number(v) and math.isfinite(v) for v in values)
            ):
                raise ValueError(f"{name} must be {self.num_heads} finite numbers (one per query head)")
            object.__setattr__(self, name, tuple(float(v) for v in values))  # a manifest's JSON list

    def _check_indexer(self) -> None:
        """The indexer fields that belong together (the comment above them)."""
        if self.index_topk is None or self.index_dim is None:
            raise ValueError("an indexer needs index_topk and index_dim")
        if self.index_pool not in (None, "mean", "gated"):
            raise ValueError(f"index_pool must be 'mean' or 'gated', got {self.index_pool!r}")
        if (self.index_block is None) != (self.index_pool is None):
            raise ValueError("a pooling indexer needs index_block and index_pool, and only it has them")
        scaled = is_positive_finite(self.index_scale)
        if self.index_pool is None and not (scaled and self.index_eps is None):
            raise ValueError("an indexer needs a positive index_scale (index_eps belongs to a pooling indexer)")
        if self.index_pool == "mean" and not (self.index_scale is None and is_positive_finite(self.index_eps)):
            raise ValueError("a mean-pooling indexer needs a positive index_eps and no index_scale")
        if self.index_pool == "gated" and not (scaled and self.index_eps is None):
            raise ValueError("a gated-pooling indexer needs a positive index_scale and no index_eps")
        if self.keys_read is not None or self.score_terms - {"sink_logits"}:
            raise ValueError("an indexer's selection is computed over causal attention, with sinks at most")

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def score_terms(self) -> frozenset[str]:
        """The ``SCORE_TERMS`` this attention's scores carry."""
        return frozenset(name for name in SCORE_TERMS if getattr(self, name) is not None)

    @property
    def keys_read(self) -> int | None:
        """The most keys a query reads (the model's own window or chunk); None: every earlier key."""
        return self.window if self.chunk is None else self.chunk

    @property
    def per_query_terms(self) -> bool:
        """Whether the queries bring terms of their own (a relative bias, sink logits): inputs of the
        cell's call that only ``exact`` takes."""
        return bool(self.score_terms & PER_QUERY_TERMS)

    @property
    def selects(self) -> bool:
        """Whether an indexer chooses the keys each query reads (``index_topk``)."""
        return self.index_topk is not None

    @property
    def selected_keys(self) -> int | None:
        """The most keys an indexer lets a query read: ``index_topk``, or a pooling indexer's pools and
        its unfinished pool of up to ``index_block - 1`` keys; None without an indexer."""
        if self.index_block is None:
            return self.index_topk
        return self.index_topk // self.index_block * self.index_block + self.index_block - 1

    def to_json(self) -> dict[str, Any]:
        """The fields, without score terms, a chunk or an indexer the site does not have (a manifest
        without them reads as before)."""
        return {k: v for k, v in asdict(self).items() if k not in _OPTIONAL or v is not None}


class Cell(nn.Module):
    """Base class: subclasses set ``target``/``state_names`` and implement the methods below."""

    target: ClassVar[str]
    grows_with_context: ClassVar[bool] = False
    uses_query: ClassVar[bool] = True  # False: q is ignored (Aaren), so training leaves what only feeds q alone
    calibrates: ClassVar[bool] = False  # True: ``calibrate`` initialises the cell from data (Aaren's query)
    # Per instance where the options change them (a class default otherwise): the state's names, in
    # the order of ``init_state``, and whether the cell also reads the layer input ``x``.
    state_names: tuple[str, ...]
    needs_input: bool = False
    # Phases ("prefill": T > 1, "decode": T == 1) in which the cell's own PyTorch forms are faster
    # than its fused ops' PyTorch references (docs/performance.md §Which path kernels "auto" runs):
    # with kernels "auto" where Triton does not run, those phases take the cell's own forms.
    own_forms_without_triton: ClassVar[frozenset[str]] = frozenset()
    # Options that manifests saved before the option existed lack, at the value those models were
    # built with, where the default has changed since (``rnnify.load`` fills them in).
    manifest_defaults: ClassVar[dict[str, Any]] = {}
    # Parameters that weigh the cell's parts against each other, one scalar per head (the hybrid's
    # memory gate): AdamW moves a weight by about its rate a step whatever the gradient, so a few
    # steps at a projection's rate leave them near their start; distillation trains them at a
    # multiple of it (``gate_lr_scale``).
    gates: ClassVar[tuple[str, ...]] = ()
    # True for a cell that carries one of the model's own recurrent layers (a short convolution, a
    # Mamba scan) unchanged, not an attention site: nothing replaces it, so nothing is compared there.
    own_layer: ClassVar[bool] = False
    # The SCORE_TERMS the cell computes; a site whose scores carry another is refused, never dropped.
    score_terms: ClassVar[frozenset[str]] = frozenset()
    # Whether the cell computes a model's own chunked attention (``CellSpec.chunk``); else refused.
    computes_chunks: ClassVar[bool] = False
    # Whether the cell computes an indexer's selection (``CellSpec.index_topk``); else refused.
    computes_selection: ClassVar[bool] = False
    # The dtype the cell stores its keys and values in where that is not the model's (a window's or a
    # selection cache's ``kv_dtype``, ``rnnify.kernels.slots``); None: the model's.
    storage: torch.dtype | None = None

    def __init__(self, spec: CellSpec):
        super().__init__()
        missing = sorted(spec.score_terms - self.score_terms)
        if missing:
            carriers = sorted({cls.target for cls in _subclasses(Cell) if spec.score_terms <= cls.score_terms})
            raise ValueError(
                f"cannot compute this attention's {' and '.join(SCORE_TERMS[name] for name in missing)}"
                + (f"; {' and '.join(carriers)} can" if carriers else "")
            )
        if spec.chunk is not None and not self.computes_chunks:
            raise ValueError(
                f"this attention attends in chunks of {spec.chunk} tokens (the model's own chunked attention), "
                "which only --to exact computes (its state is bounded by the chunk already)"
            )
        if spec.selects and not self.computes_selection:
            raise ValueError(
                f"this attention reads only the {spec.selected_keys} earlier keys its indexer selects (sparse "
                "attention), which only --to exact computes, for all of a layer's heads"
            )
        self.spec = spec
        self.kernels: str | None = None  # backend of the fused ops in use; None: the cell's own PyTorch forms
        # True while a decode step may write the new state into the tensors of the state it was given
        # (``RecurrentModel.step(donate=True)``, for cells whose ``overwrites_state``)
        self.overwrite_state = False

    def options(self) -> dict[str, Any]:
        """JSON-able options that rebuild this cell with ``type(cell)(spec, **options)``."""
        raise NotImplementedError

    def init_state(self, batch_size: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """The state before any token."""
        raise NotImplementedError

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, *state: torch.Tensor):
        raise NotImplementedError

    def state_nbytes(self, length: int, batch_size: int = 1, dtype: torch.dtype = torch.float32) -> int:
        """Bytes of state held after ``length`` tokens."""
        state = self.init_state(batch_size, torch.device("meta"), dtype)
        return sum(t.numel() * t.element_size() for t in state) + (
            self._bytes_per_token(dtype) * length * batch_size if self.grows_with_context else 0
        )

    def fused_ops(self) -> dict[str, str]:
        """The ``rnnify.kernels`` op the fused form runs per phase (``"prefill"``: T > 1, ``"decode"``:
        T == 1); a phase left out keeps the PyTorch form. Empty: no fused form (the default)."""
        return {}

    def use_kernels(self, kernels: str) -> dict[str, str]:
        """Run ``fused_ops`` with backend ``kernels``, or the cell's own PyTorch forms with ``"none"``
        (``rnnify.kernels.utils.KERNELS``); returns the ops now in use (empty for a cell without a
        fused form)."""
        ops = self.fused_ops() if check_kernels(kernels) != "none" else {}
        self.kernels = kernels if ops else None
        return ops

    def backend(self, x: torch.Tensor, steps: int) -> str | None:
        """The fused ops' backend for a call of ``steps`` tokens on tensors like ``x``, or None: the
        cell's own PyTorch forms (``kernels`` "none", or "auto" off Triton in a phase of
        ``own_forms_without_triton``: the same math, computed faster)."""
        if self.kernels == "auto" and ("decode" if steps == 1 else "prefill") in self.own_forms_without_triton:
            return "auto" if resolve_backend("auto", x) else None
        return self.kernels

    def overwrites_state(self, x: torch.Tensor) -> bool:
        """Does a decode step on tensors like ``x`` write its new state into the given one where
        ``overwrite_state`` allows it (rather than copy it anyway)? False here."""
        return False

    def calibrate(self, q: torch.Tensor, mask: torch.Tensor | None = None) -> "Cell":
        """Initialise from the ``q [B, H, T, d]`` this cell receives on calibration data (``mask [B, T]``:
        real tokens); ``RecurrentModel.calibrate`` calls it on cells with ``calibrates``. A no-op here."""
        return self

    @property
    def exact(self) -> bool:
        """True when the cell computes what the source did unchanged, softmax attention or one of the
        model's own layers (``verify`` then judges it against the original)."""
        return self.target == "exact" or self.own_layer

    @property
    def exact_span(self) -> int | None:
        """The row length up to which an approximating cell still reads every token by softmax (its
        window, sinks and kept tokens hold them all), so that training it towards the original on
        rows no longer than this teaches its memory nothing; None where no window holds the tokens."""
        return None

    def describe(self) -> str:
        """A short note for ``rnnify info`` (e.g. recurrent neurons per head); empty by default."""
        return ""

    def _bytes_per_token(self, dtype: torch.dtype) -> int:
        return 0

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in {**self.spec.to_json(), **self.options()}.items())


def _subclasses(cls: type) -> list[type]:
    """Every subclass of ``cls`` defined so far, with a ``target``."""
    found = []
    for sub in cls.__subclasses__():
        found += ([sub] if hasattr(sub, "target") else []) + _subclasses(sub)
    return found
