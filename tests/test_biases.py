"""Models whose attention adds to its scores: ALiBi (Falcon-RW through SDPA's float mask, Bloom and
MPT op by op), logit softcapping (Gemma 2) and learned sinks (gpt-oss's in the softmax, Granite's as
a scale of its output), all run as eager attention but Falcon. Each tiny model (random weights) is converted from its directory and held to
the original Hugging Face model run in float64; a bias of another shape, an attention chain
rnnify does not recognise and a target that cannot compute a term are refused in one line that
names the layer (rnnify/compiler/passes/find_attention.py, eager_attention.py)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
import transformers
from support import decode, rel_diff
from torch import nn
from torch.export import Dim

import rnnify
from rnnify.cli import main
from rnnify.compiler.capture import _plain_graph_module
from rnnify.compiler.passes import PIPELINE, PassContext, run_pipeline
from rnnify.compiler.passes.find_attention import find_attention, sites
from rnnify.errors import RnnifyError, UnsupportedModelError

VOCAB, TOKENS, PROMPT = 256, 24, 8
HEADS = 4


def _falcon_rw():
    """Falcon-RW's layout: ALiBi, one fused query/key/value per head, no multi-query."""
    return transformers.FalconConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=HEADS,
        alibi=True,
        multi_query=False,
        new_decoder_architecture=False,
        parallel_attn=False,
        bias=True,
    )


CONFIGS = {
    "falcon-rw": _falcon_rw,
    "bloom": lambda: transformers.BloomConfig(vocab_size=VOCAB, hidden_size=64, n_layer=2, n_head=HEADS),
    "mpt": lambda: transformers.MptConfig(
        vocab_size=VOCAB, d_model=64, n_layers=2, n_heads=HEADS, expansion_ratio=2, max_seq_len=128
    ),
    # weights large enough that scores reach the cap: softcapping changes the logits by a few percent
    "gemma2": lambda: transformers.Gemma2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=HEADS,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
        attn_logit_softcapping=4.0,
        initializer_range=0.3,
    ),
    "gpt_oss": lambda: transformers.GptOssConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=HEADS,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
    ),
    # sinks as a scale of the output, sigmoid(logsumexp(scores) - sink)
    "granite_swa": lambda: transformers.GraniteSWAConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=HEADS,
        num_key_value_heads=2,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
    ),
}
TERM = {"falcon-rw": "alibi_slopes", "bloom": "alibi_slopes", "mpt": "alibi_slopes"}
TERM.update({"gemma2": "softcap", "gpt_oss": "sink_logits", "granite_swa": "sink_logits"})
TERM_NAME = {
    "alibi_slopes": "ALiBi position bias",
    "softcap": "logit softcapping",
    "sink_logits": "learned attention sinks",
}
WINDOWED = {"gemma2", "gpt_oss", "granite_swa"}  # layer 0 slides over 8 tokens, layer 1 attends to all


def _build(name: str) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    config = CONFIGS[name]()
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    if name in ("gpt_oss", "granite_swa"):  # sinks of a few units (they start near 0): they change the logits
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_(0.0, 2.0)
    return model


@pytest.fixture(scope="module")
def source_dir(tmp_path_factory):
    """``source_dir(name)`` -> directory of the tiny random model, saved once."""
    saved = {}

    def get(name: str):
        if name not in saved:
            saved[name] = tmp_path_factory.mktemp(name)
            _build(name).save_pretrained(saved[name])
        return saved[name]

    return get


def _load(directory, name: str) -> transformers.PreTrainedModel:
    """The Hugging Face model from ``directory`` in float64 (gpt-oss in float32: its experts' grouped
    matmul takes no float64)."""
    dtype = torch.float32 if name == "gpt_oss" else torch.float64
    return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).eval()


@pytest.fixture(scope="module")
def original(source_dir):
    """``original(name)`` -> the Hugging Face model from its directory (``_load``)."""
    loaded = {}

    def get(name: str):
        if name not in loaded:
            loaded[name] = _load(source_dir(name), name)
        return loaded[name]

    return get


@pytest.fixture(scope="module")
def converted(source_dir):
    """``converted(name, target, **options)`` -> ``rnnify.convert`` of the model's directory, once."""
    done = {}

    def get(name: str, target: str = "exact", **options):
        key = (name, target, tuple(sorted(options.items())))
        if key not in done:
            done[key] = rnnify.convert(source_dir(name), to=target, **options)
        return done[key]

    return get


def _ids(batch: int = 1, length: int = TOKENS, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


# --------------------------------------------------------------------------- exact


@pytest.mark.parametrize("name", list(CONFIGS))
def test_exact_equals_the_original_in_prefill_and_steps(name, converted, original):
    model = converted(name)
    assert {cell.spec.score_terms for cell in model.cells} == {frozenset({TERM[name]})}
    ids = _ids()
    want = _logits(original(name), ids)
    with torch.no_grad():
        prefill, _ = model.prefill(ids)
        stepped, _ = decode(model, ids, PROMPT)
    assert rel_diff(prefill, want) < 1e-4
    assert rel_diff(stepped, want) < 1e-4


@pytest.mark.parametrize("name", ["falcon-rw", "bloom", "mpt"])
def test_the_slopes_read_are_the_models_own(name, converted):
    """The probe's slopes against each model's own ALiBi table, built here at 2 positions."""
    modeling = {
        "falcon-rw": transformers.models.falcon.modeling_falcon,
        "bloom": transformers.models.bloom.modeling_bloom,
    }
    if name == "mpt":
        table = transformers.models.mpt.modeling_mpt.build_mpt_alibi_tensor(HEADS, 2)  # [H, 1, 2]: slope (j - 1)
        slopes = table[:, 0, 1] - table[:, 0, 0]
    else:
        table = modeling[name].build_alibi_tensor(torch.ones(1, 2, dtype=torch.long), HEADS, torch.float32)
        slopes = table[:, 0, 1]  # slope times position 1
        if name == "falcon-rw":
            slopes = slopes / math.sqrt(64 // HEADS)  # Falcon scales its bias as the scores
    for cell in converted(name).cells:
        assert cell.spec.alibi_slopes == pytest.approx(slopes.tolist(), rel=1e-6)


@pytest.mark.parametrize("name", ["falcon-rw", "bloom", "gpt_oss"])
def test_a_left_padded_row_equals_the_row_alone(name, converted):
    """Positions, and so ALiBi's distances, count a row's real tokens only."""
    model = converted(name)
    ids = _ids(2, 16)
    mask = torch.ones(2, 16, dtype=torch.bool)
    mask[1, :5] = False
    with torch.no_grad():
        padded, _ = model.prefill(ids, attention_mask=mask)
        alone, _ = model.prefill(ids[1:, 5:])
    assert rel_diff(padded[1:, 5:], alone) < 1e-5


def test_the_terms_change_the_originals_logits(source_dir, original):
    """Without its softcap or its sinks each model computes something else: the checks above can fail."""
    ids = _ids()
    gemma = _load(source_dir("gemma2"), "gemma2")
    for layer in gemma.model.layers:
        layer.self_attn.attn_logit_softcapping = None
    assert rel_diff(_logits(gemma, ids), _logits(original("gemma2"), ids)) > 1e-2
    for name in ("gpt_oss", "granite_swa"):
        without = _load(source_dir(name), name)
        with torch.no_grad():
            for layer in without.model.layers:
                layer.self_attn.sinks.fill_(-1e4)
        assert rel_diff(_logits(without, ids), _logits(original(name), ids)) > 1e-2, name


def test_mpt_reads_past_the_length_it_was_captured_for(converted):
    """MPT is exported for fewer tokens than its ALiBi table (capture.py); the cells compute the bias
    for any length: a prompt longer than the table steps as it prefills."""
    model = converted("mpt")
    ids = _ids(1, 150)
    with torch.no_grad():
        prefill, _ = model.prefill(ids)
        stepped, _ = decode(model, ids, 120)
    assert rel_diff(stepped, prefill) < 1e-4


# --------------------------------------------------------------------------- window


@pytest.mark.parametrize("name", list(CONFIGS))
def test_window_steps_equal_its_prefill(name, converted):
    model = converted(name, "window", window=4, sinks=1)
    assert all(cell.kernels is None for cell in model.cells)  # the fused step computes no score terms
    ids = _ids()
    with torch.no_grad():
        prefill, _ = model.prefill(ids)
        stepped, _ = decode(model, ids, PROMPT)
    assert rel_diff(stepped, prefill) < 1e-4


@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_window_as_long_as_the_context_equals_the_original(name, converted, original):
    """A window over every token read is softmax attention; layers with a window of their own keep it."""
    options = {"layers": "1:window(window=64)"} if name in WINDOWED else {"window": 64}
    model = converted(name, "window", **options)
    ids = _ids()
    with torch.no_grad():
        stepped, _ = decode(model, ids, PROMPT)
    assert rel_diff(stepped, _logits(original(name), ids)) < 1e-4


# --------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(("name", "target"), [("bloom", "linear"), ("gemma2", "gated"), ("gpt_oss", "hybrid")])
def test_a_target_that_cannot_compute_the_term_is_refused(name, target, source_dir):
    where = {"bloom": r"transformer\.h\.0\.self_attention", "gemma2": r"model\.layers\.0\.self_attn"}
    where["gpt_oss"] = where["gemma2"]
    with pytest.raises(RnnifyError, match=rf"layer 0 \({where[name]}\): target '{target}': .*{TERM_NAME[TERM[name]]}"):
        rnnify.convert(source_dir(name), to=target, window=4) if target == "hybrid" else rnnify.convert(
            source_dir(name), to=target
        )


@pytest.fixture
def bent_falcon_bias(monkeypatch):
    """Falcon's bias made sqrt(slope position): not linear in the distance."""
    modeling = transformers.models.falcon.modeling_falcon
    build = modeling.build_alibi_tensor
    monkeypatch.setattr(modeling, "build_alibi_tensor", lambda mask, heads, dtype: build(mask, heads, dtype).sqrt())


def test_a_float_mask_bias_that_is_not_alibi_is_refused_in_one_line(bent_falcon_bias, tmp_path, capsys):
    source = tmp_path / "falcon"
    _build("falcon-rw").save_pretrained(source)
    code = main(["convert", str(source), "--to", "exact", "-o", str(tmp_path / "out"), "--no-compile"])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and "Traceback" not in err and len(errors) == 1
    assert "layer 0 (transformer.h.0.self_attention)" in errors[0] and "not ALiBi's" in errors[0]
    assert not (tmp_path / "out").exists()


class _Eager(nn.Module):
    """Attention op by op, ``mode`` choosing what happens to the scores; layers of a toy LM."""

    def __init__(self, mode: str, width: int = 16, heads: int = 2):
        super().__init__()
        self.mode, self.heads, self.head_dim = mode, heads, width // heads
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) * self.head_dim**-0.5
        i = torch.arange(t, device=x.device)
        causal = torch.where(i[None, :] <= i[:, None], 0.0, float("-inf"))
        if self.mode == "causal":
            scores = scores + causal
        elif self.mode == "alibi":
            scores = scores + 0.5 * (i[None, :] - i[:, None]) + causal
        elif self.mode == "bent":  # a bias that grows with the squared distance: not ALiBi's
            scores = scores - 0.1 * (i[None, :] - i[:, None]) ** 2 + causal
        elif self.mode == "squared":  # an op rnnify does not know on the scores
            scores = scores * scores + causal
        elif self.mode == "bidirectional":  # no mask at all
            pass
        elif self.mode == "read_twice":  # the scores also feed something the cell would not compute
            scores = scores + causal
        else:
            raise ValueError(self.mode)
        o = self.out((F.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(b, t, -1))
        return o + scores.amax(-1).mean(1)[..., None] if self.mode == "read_twice" else o


class _EagerLM(nn.Module):
    def __init__(self, modes: list[str], vocab: int = 50, width: int = 16):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(_Eager(mode, width) for mode in modes)
        self.head = nn.Linear(width, vocab)

    def forward(self, input_ids, position_ids):
        x = self.embed(input_ids)
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)


def _find_attention(module: nn.Module) -> torch.fx.GraphModule:
    torch.manual_seed(0)
    ids = torch.randint(0, 50, (2, 8))
    dims = {0: Dim("batch", min=1, max=1024), 1: Dim("length", min=2, max=4096)}
    program = torch.export.export(module.eval(), (ids, torch.arange(8).expand(2, 8)), dynamic_shapes=(dims, dims))
    ctx = PassContext()
    gm = run_pipeline(_plain_graph_module(program.module()), ctx, PIPELINE[: PIPELINE.index(find_attention)])
    return find_attention(gm, ctx)


def test_eager_attention_of_a_toy_model_is_found_with_its_bias():
    found = [site for _, site in sites(_find_attention(_EagerLM(["causal", "alibi"])))]
    assert [(s.layer, s.num_heads, s.scale, s.alibi_slopes) for s in found] == [
        (0, 2, pytest.approx(8**-0.5), None),
        (1, 2, pytest.approx(8**-0.5), (0.5, 0.5)),
    ]


@pytest.mark.parametrize(
    ("mode", "message"),
    [
        ("squared", r"attention computed op by op, with an op on the scores it does not match"),
        ("bidirectional", "not causal"),
        ("bent", "a position bias that is not ALiBi's"),
        ("read_twice", "also read by"),
    ],
)
def test_eager_attention_that_cannot_convert_is_refused_naming_the_layer(mode, message):
    with pytest.raises(UnsupportedModelError, match=rf"layer 1 \(layers\.1\): .*{message}"):
        _find_attention(_EagerLM(["causal", mode]))
