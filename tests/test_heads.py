"""Per-head targets: HeadSplitCell against a naive per-head reference, the ``heads(...)`` layer
syntax, all-exact maps against the original model, and ``--to auto`` on a model with one head
built to retrieve."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch

import rnnify
from rnnify.auto import HeadScorer, auto_convert, choose_heads
from rnnify.cells import CellSpec, HeadSplitCell, build_cell
from rnnify.compiler.plan import make_plan, parse_layers
from rnnify.errors import RnnifyError
from rnnify.verify import run_checks
from tests.support import rel_diff
from tests.test_cli import assert_user_error, run

SPEC = CellSpec(num_heads=8, num_kv_heads=4, head_dim=8, value_dim=6, scale=8**-0.5)
GROUPS = [  # kv 2 exact, kv 0 and 3 windowed, kv 1 exact again: out of order, uneven
    {"kv_heads": [2], "target": "exact", "options": {}},
    {"kv_heads": [3, 0], "target": "window", "options": {"window": 4, "sinks": 1}},
    {"kv_heads": [1], "target": "exact", "options": {}},
]


def reference(q, k, v, window_of: dict[int, tuple[int, int] | None]) -> torch.Tensor:
    """Per query head h in float64: softmax over the keys of kv head h // G it may see (all
    earlier ones, or with ``(W, S)`` the last W and the first S)."""
    batch, heads, length, _ = q.shape
    group = heads // k.shape[1]
    out = torch.zeros(batch, heads, length, v.shape[-1], dtype=torch.float64)
    for h in range(heads):
        kv = h // group
        for i in range(length):
            keys = [
                j for j in range(i + 1) if window_of[kv] is None or i - j < window_of[kv][0] or j < window_of[kv][1]
            ]
            s = torch.stack([(q[:, h, i].double() * k[:, kv, j].double()).sum(-1) * SPEC.scale for j in keys], -1)
            out[:, h, i] = (torch.softmax(s, -1)[..., None] * v[:, kv, keys].double()).sum(-2)
    return out


def run_steps(cell, q, k, v, state):
    mask = torch.ones(q.shape[0], 1, dtype=torch.bool)
    outs = []
    for t in range(q.shape[2]):
        out, *state = cell(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], mask, *state)
        outs.append(out)
    return torch.cat(outs, 2), state


def test_head_split_matches_a_per_head_reference_in_prefill_steps_and_split():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, n, 11, d, generator=gen) for n, d in ((8, 8), (4, 8), (4, 6)))
    cell = build_cell("heads", SPEC, {"groups": GROUPS})
    want = reference(q, k, v, {0: (4, 1), 1: None, 2: None, 3: (4, 1)})
    mask = torch.ones(2, 11, dtype=torch.bool)
    full, *_ = cell(q, k, v, mask, *cell.init_state(2, torch.device("cpu"), torch.float32))
    assert rel_diff(full, want) < 1e-5
    stepped, _ = run_steps(cell, q, k, v, cell.init_state(2, torch.device("cpu"), torch.float32))
    assert rel_diff(stepped, want) < 1e-5
    first, *state = cell(
        q[:, :, :5], k[:, :, :5], v[:, :, :5], mask[:, :5], *cell.init_state(2, torch.device("cpu"), torch.float32)
    )
    second, *_ = cell(q[:, :, 5:], k[:, :, 5:], v[:, :, 5:], mask[:, 5:], *state)
    assert rel_diff(torch.cat([first, second], 2), want) < 1e-5
    # the window heads really are windowed: at the last query they differ from full attention
    full_attention = reference(q, k, v, dict.fromkeys(range(4)))
    assert rel_diff(full[:, [0, 1, 6, 7], -1], full_attention[:, [0, 1, 6, 7], -1]) > 1e-2


def test_head_split_state_is_its_parts_and_options_rebuild_it():
    cell = build_cell("heads", SPEC, {"groups": GROUPS})
    parts = [
        build_cell(g["target"], CellSpec(len(g["kv_heads"]) * 2, len(g["kv_heads"]), 8, 6, SPEC.scale), g["options"])
        for g in GROUPS
    ]
    assert cell.state_nbytes(1000) == sum(p.state_nbytes(1000) for p in parts)
    assert cell.grows_with_context and not cell.exact
    again = build_cell("heads", SPEC, json.loads(json.dumps(cell.options())))
    assert again.options() == cell.options() and again.state_names == cell.state_names
    assert "kv 3,0: window (window=4, sinks=1)" in cell.describe()


@pytest.mark.parametrize(
    "groups, message",
    [
        ([{"kv_heads": [0, 1], "target": "exact"}], "exactly one group"),
        ([{"kv_heads": [0, 1, 2, 3], "target": "exact"}, {"kv_heads": [1], "target": "exact"}], "exactly one group"),
        ([{"kv_heads": [0, 1, 2, 3], "target": "nope"}], "unknown target"),
    ],
)
def test_head_split_rejects_bad_groups(groups, message):
    with pytest.raises(RnnifyError, match=message):
        build_cell("heads", SPEC, {"groups": groups})


def test_layer_syntax_round_trips_and_resolves_the_heads_not_named():
    rules = parse_layers("0-:heads(0,2-3=exact;*=window),1:linear")
    assert [str(r) for r in rules] == ["0-:heads(0,2,3=exact;*=window)", "1:linear"]
    plan = make_plan("hybrid", "0:heads(1=exact)", window=4)
    cell = plan.cell_for(0, SPEC)
    assert isinstance(cell, HeadSplitCell)
    assert cell.options()["groups"][0]["kv_heads"] == [1]
    assert [g["target"] for g in cell.options()["groups"]] == ["exact", "hybrid"]
    assert cell.kv_heads[1] == [0, 2, 3]
    one = make_plan("window", "0:heads(0,1=exact)", window=4)
    assert type(one.cell_for(0, CellSpec(4, 2, 8, 8, 1.0))).__name__ == "ExactCell"  # one group: the plain cell
    with pytest.raises(RnnifyError, match="kv heads 0-3, not 5"):
        make_plan("window", "0:heads(5=exact)", window=4).cell_for(0, SPEC)


@pytest.mark.parametrize(
    "spec, message",
    [
        ("0:heads(0=exact", "heads(HEADS=TARGET"),
        ("0:heads(x=exact)", "must be numbers"),
        ("0:heads(0=exact;0=window)", "named twice"),
        ("0:heads(0=foo)", "unknown target"),
        ("0:heads(0=heads)", "unknown target"),
        ("0:heads(0=window(foo=1))", "window takes no option foo"),
        ("0:heads(0=window(window=8)", "expected window(KEY=VALUE"),
        ("0:window(8)", "expected KEY=VALUE"),
    ],
)
def test_bad_head_specs_are_one_line_cli_errors(capsys, tmp_path, tiny_model_dir, spec, message):
    code, _, err = run(
        capsys,
        "convert",
        tiny_model_dir("llama"),
        "--to",
        "window",
        "--window",
        "4",
        "--layers",
        spec,
        "-o",
        tmp_path / "o",
    )
    assert_user_error(code, err, message)
    assert not (tmp_path / "o").exists()


def test_a_rule_s_own_options_give_heads_their_own_windows():
    plan = make_plan("window", "0-:heads(0,1=window(window=6);*=window),1:window(sinks=0)", window=3, sinks=1)
    assert plan.describe() == "*:window,0-:heads(0,1=window(window=6);*=window),1:window(sinks=0)"
    assert [str(r) for r in parse_layers(plan.describe().removeprefix("*:window,"))] == [str(r) for r in plan.rules]
    cell = plan.cell_for(0, SPEC)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, n, 11, d, generator=gen) for n, d in ((8, 8), (4, 8), (4, 6)))
    mask = torch.ones(2, 11, dtype=torch.bool)
    full, *_ = cell(q, k, v, mask, *cell.init_state(2, torch.device("cpu"), torch.float32))
    assert rel_diff(full, reference(q, k, v, {0: (6, 1), 1: (6, 1), 2: (3, 1), 3: (3, 1)})) < 1e-5
    assert plan.cell_for(1, SPEC).options()["sinks"] == 0 and plan.cell_for(1, SPEC).options()["window"] == 3


def test_all_exact_head_map_is_the_original_and_saves(tmp_path, tiny_model_dir):
    source = tiny_model_dir("llama")  # 4 query heads on 2 kv heads (GQA)
    model = rnnify.convert(source, to="window", layers="0-:heads(1=exact;*=exact)")
    assert all(isinstance(c, HeadSplitCell) and c.kv_heads == [[1], [0]] for c in model.cells)
    checks = {r.name: r for r in run_checks(model, source, tokens=24)}
    assert checks["step == prefill"].passed and checks["split prefill"].passed
    assert checks["vs original"].passed  # judged: every head is exact
    model.save(tmp_path / "m")
    loaded = rnnify.load(tmp_path / "m")
    assert loaded.manifest.layers == ["0-:heads(1=exact;*=exact)"]
    assert [c.options() for c in loaded.cells] == [c.options() for c in model.cells]
    ids = torch.randint(0, 300, (2, 20), generator=torch.Generator().manual_seed(1))
    assert torch.equal(loaded.prefill(ids)[0], model.prefill(ids)[0])


# -- auto ----------------------------------------------------------------------------------

BOS, MARKER, LENGTH = 1, 2, 40


@pytest.fixture(scope="module")
def retrieval_model(tmp_path_factory):
    """A tiny Llama (2 layers x 2 kv heads) whose layer-0 kv head 1 attends to a marker token
    wherever it is, and whose other heads attend to the first token (a sink) or write nothing.

    Query = a bias on the slowest rotary pair (dims 3 and 7 of 8 barely rotate over 40 tokens),
    key = that pair reading one direction of the normed input: the marker's embedding for the
    retrieval head, the first token's for the sink head."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.conftest import make_tiny

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=128,
        vocab_size=320,
        attention_bias=True,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        embed = model.model.embed_tokens.weight
        embed[:, :2] = 0
        embed[MARKER] = 0
        embed[MARKER, 0] = 1.0
        embed[BOS] = 0
        embed[BOS, 1] = 1.0
        for layer in model.model.layers:
            attn = layer.self_attn
            for proj in (attn.q_proj, attn.k_proj):
                proj.weight.zero_()
                proj.bias.zero_()
            attn.q_proj.bias.view(4, 8)[:, 3] = 1.0  # every query head reads the slow pair
            attn.k_proj.weight.view(2, 8, 32)[:, 3, 1] = 8.0  # keys: "is this the first token"
        attn = model.model.layers[0].self_attn
        attn.k_proj.weight.view(2, 8, 32)[1, 3] = 0
        attn.k_proj.weight.view(2, 8, 32)[1, 3, 0] = 8.0  # kv head 1: "is this the marker"
        attn.v_proj.weight.view(2, 8, 32)[1] = 5 * torch.eye(8, 32)
        model.model.layers[1].self_attn.v_proj.weight.zero_()  # layer 1 writes nothing
    directory = tmp_path_factory.mktemp("retrieval")
    model.save_pretrained(directory)
    make_tiny.train_tokenizer().save_pretrained(directory)
    gen = torch.Generator().manual_seed(0)
    rows = torch.randint(3, 320, (3, LENGTH), generator=gen)
    rows[:, 0] = BOS
    rows[:, 2] = MARKER  # far behind the 4-token window of the later queries
    return directory, rows


AUTO = {"context": 1024, "window": 4, "sinks": 1, "calib_len": LENGTH, "calib_rows": 3, "passkey": 0}


def auto(directory, rows, **kwargs):
    """The heads ``--to auto`` keeps exact (the report; no conversion)."""
    return choose_heads(directory, rows, **AUTO, **kwargs)


def test_auto_keeps_the_retrieval_head_exact(retrieval_model):
    directory, rows = retrieval_model
    model, report = auto_convert(directory, rows, budget="30%", score="kl", **AUTO)  # room for one exact head of four
    assert report.retrieval == [(0, 1)]
    for score in ("kl", "mass"):  # scoring by kl measures both
        assert max(report.scores[score], key=report.scores[score].get) == "0.1"
    layer0 = model.cells[0]
    assert isinstance(layer0, HeadSplitCell) and [p.target for p in layer0.parts] == ["exact", "window"]
    assert layer0.kv_heads == [[1], [0]] and model.cells[1].target == "window"
    assert report.state_bytes == model.state_nbytes(1024) <= 0.3 * report.kv_cache_bytes
    assert report.calibration_kl < 1e-3  # the heads windowed lose (almost) nothing
    checks = {r.name: r for r in run_checks(model, tokens=24)}
    assert checks["step == prefill"].passed and checks["split prefill"].passed
    assert json.loads(model.files["head_map.json"])["retrieval"] == [[0, 1]]


def test_kl_score_is_a_full_pass_with_the_head_windowed(retrieval_model, tiny_model_dir):
    _, rows = retrieval_model
    scorer = HeadScorer(tiny_model_dir("llama"), rows, score="kl", **{k: v for k, v in AUTO.items() if k != "context"})
    assert min(scorer.scores["kl"].values()) > 1e-6  # random weights: every head matters a little
    for head in scorer.heads:  # scored from the earlier layers' recorded outputs; measured here by full passes
        assert scorer.scores["kl"][head] == pytest.approx(scorer.kl(set(scorer.heads) - {head}), rel=1e-4)


def test_auto_max_kl_per_layer_and_mass(retrieval_model):
    directory, rows = retrieval_model
    assert auto(directory, rows, budget="30%", score="mass").retrieval == [(0, 1)]
    report = auto(directory, rows, max_kl=1e-3, score="kl")
    assert report.retrieval == [(0, 1)]
    report = auto(directory, rows, budget="60%", per_layer=True)
    assert report.retrieval == [(0, 0), (0, 1)]


def test_auto_retrieval_window_keeps_the_state_constant(retrieval_model):
    directory, rows = retrieval_model
    model, report = auto_convert(directory, rows, max_kl=1e-3, retrieval_window=LENGTH, **AUTO)
    assert report.retrieval == [(0, 1)] and report.layers == f"0:heads(1=window(window={LENGTH}))"
    layer0 = model.cells[0]
    assert [(p.target, p.options()["window"]) for p in layer0.parts] == [("window", LENGTH), ("window", 4)]
    assert model.constant_memory and model.state_nbytes(1024) == model.state_nbytes(100_000) == report.state_bytes
    assert report.calibration_kl < 1e-3  # a window as long as the rows: the marker stays in reach
    checks = {r.name: r for r in run_checks(model, tokens=24)}
    assert checks["step == prefill"].passed and checks["split prefill"].passed
    scorer = HeadScorer(directory, rows, **{k: v for k, v in AUTO.items() if k != "context"})
    assert scorer.kl({(0, 1)}, 16) > 10 * scorer.kl({(0, 1)}, LENGTH) + 1e-3  # the marker (token 2) leaves 16
    with pytest.raises(RnnifyError, match="above --window"):
        scorer.choose(budget="30%", retrieval_window=4)
    with pytest.raises(RnnifyError, match="cannot be met with --retrieval-window 6"):
        scorer.choose(max_kl=1e-6, retrieval_window=6)


def test_auto_retrieval_keep_selects_what_the_head_reads(retrieval_model):
    from transformers import AutoModelForCausalLM

    directory, rows = retrieval_model
    scorer = HeadScorer(directory, rows, **{k: v for k, v in AUTO.items() if k != "context"})
    # an 8-token window loses the marker (token 2) for the later queries; 4 selected tokens keep it
    assert scorer.kl({(0, 1)}, 8, 4) < scorer.kl({(0, 1)}, 8) / 10
    model, report = auto_convert(directory, rows, max_kl=1e-3, retrieval_window=8, retrieval_keep=4, **AUTO)
    assert report.retrieval == [(0, 1)] and report.layers == "0:heads(1=select(window=8,keep=4))"
    assert report.retrieval_keep == 4
    layer0 = model.cells[0]
    assert [(p.target, p.options()["window"]) for p in layer0.parts] == [("select", 8), ("window", 4)]
    assert layer0.parts[0].options()["keep"] == 4
    assert model.constant_memory and model.state_nbytes(1024) == model.state_nbytes(100_000) == report.state_bytes
    # what the probe measured is what the converted model computes
    original = AutoModelForCausalLM.from_pretrained(directory).eval()
    kls = []
    with torch.no_grad():
        for row in rows:
            want = original(input_ids=row[None]).logits[0].log_softmax(-1)
            got = model.prefill(row[None])[0][0].float().log_softmax(-1)
            kls.append(float((want.exp() * (want - got)).sum(-1).mean()))
    assert report.calibration_kl == pytest.approx(sum(kls) / len(kls), rel=1e-3, abs=1e-7)
    checks = {r.name: r for r in run_checks(model, tokens=24)}
    assert checks["step == prefill"].passed and checks["split prefill"].passed
    with pytest.raises(RnnifyError, match="--retrieval-keep must be"):
        scorer.choose(budget="30%", retrieval_keep=4)


def test_auto_memory_streams_through_hybrids_that_start_as_the_window(retrieval_model, tmp_path):
    """With ``memory`` the streaming heads are hybrids: the budget counts their memory, and
    training-free (memory gated off) the model computes what the windowed choice computes."""
    directory, rows = retrieval_model
    windowed, report = auto_convert(directory, rows, max_kl=1e-3, retrieval_window=LENGTH, **AUTO)
    hybrid, with_memory = auto_convert(directory, rows, max_kl=1e-3, retrieval_window=LENGTH, memory="linear", **AUTO)
    assert with_memory.retrieval == report.retrieval == [(0, 1)] and with_memory.memory == "linear"
    layer0 = hybrid.cells[0]
    assert [(p.target, p.options()["window"]) for p in layer0.parts] == [("window", LENGTH), ("hybrid", 4)]
    assert layer0.parts[1].options()["memory"] == "linear" and hybrid.cells[1].target == "hybrid"
    assert hybrid.constant_memory and with_memory.state_bytes == hybrid.state_nbytes(1024) > report.state_bytes
    assert with_memory.head_bytes["streaming"] > report.head_bytes["streaming"]
    ids = rows[:2, :24]
    expected, _ = windowed.prefill(ids)
    got, _ = hybrid.prefill(ids)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert json.loads(hybrid.files["head_map.json"])["memory"] == "linear"
    hybrid.save(tmp_path / "m")  # its scores choose again, as for windows
    again = auto(
        directory,
        rows,
        max_kl=1e-3,
        retrieval_window=LENGTH,
        memory="linear",
        scores_from=tmp_path / "m" / "head_map.json",
    )
    assert (again.retrieval, again.memory, again.state_bytes) == ([(0, 1)], "linear", with_memory.state_bytes)
    # the smallest state counts the memories: a budget the windows meet is too small for the hybrids
    with pytest.raises(RnnifyError, match=r"4-token linear hybrid with 1 sinks, or .*\) is ([\d,]+) bytes") as error:
        auto(directory, rows, budget=1000, memory="linear")
    smallest = int(error.value.args[0].split(" is ")[1].split(" bytes")[0].replace(",", ""))
    windows_only = auto(directory, rows, budget=smallest - 1)
    assert windows_only.state_bytes < smallest
    assert auto(directory, rows, budget=smallest, memory="linear").state_bytes == smallest
    every = auto(directory, rows, budget=10**9, memory="linear")  # every head exact: no memory anywhere
    assert len(every.retrieval) == 4 and every.memory is None
    with pytest.raises(RnnifyError, match="--memory 'lstm' is not a memory"):
        choose_heads("not loaded: the name is checked first", rows, budget="30%", memory="lstm")


def test_auto_memory_options_reach_the_streaming_hybrids_and_their_bytes(retrieval_model, tmp_path):
    """``memory_options`` are the streaming hybrids' other cell options: the converted cells take
    them, the budget counts the state they make, head_map.json keeps them, and their mistakes are
    errors before any model loads."""
    directory, rows = retrieval_model
    delta = auto(directory, rows, max_kl=1e-3, retrieval_window=LENGTH, memory="delta")
    options = {"share": "mass-input", "feature_options": {"feature_dim": 8}}
    model, report = auto_convert(
        directory, rows, max_kl=1e-3, retrieval_window=LENGTH, memory="delta", memory_options=options, **AUTO
    )
    assert report.retrieval == delta.retrieval and report.memory_options == options
    streaming = model.cells[1].options()
    assert (streaming["memory"], streaming["share"], streaming["feature_options"]) == (
        "delta",
        "mass-input",
        {"feature_dim": 8},
    )
    assert model.cells[0].parts[1].options()["share"] == "mass-input"
    # the share by mass keeps the keys' feature sum besides the delta state: more bytes, all counted
    assert report.state_bytes == model.state_nbytes(1024) > delta.state_bytes
    assert report.head_bytes["streaming"] > delta.head_bytes["streaming"]
    assert json.loads(model.files["head_map.json"])["memory_options"] == options
    opened = auto_convert(
        directory,
        rows,
        max_kl=1e-3,
        retrieval_window=LENGTH,
        memory="linear",
        memory_options={"memory_init": 0.2},
        **AUTO,
    )[0]
    assert opened.cells[1].options()["memory_init"] == 0.2
    every = auto(directory, rows, budget=10**9, memory="delta", memory_options=options)  # nothing streams
    assert (every.memory, every.memory_options) == (None, {})
    unloaded = "not loaded: the options are checked first"
    for given, message in [
        ({"memory_options": {"anneal": 4}}, "anneal apply to the streaming heads' hybrids: give --memory"),
        ({"memory": "delta", "memory_options": {"share": "bogus"}}, "share must be one of"),
        ({"memory": "linear", "memory_options": {"anneal": 4}}, "anneal must be"),
        ({"memory": "delta", "memory_options": {"windw": 8}}, "windw apply to none"),
        ({"memory": "delta", "memory_options": {"window": 8}}, "give window as their own"),
    ]:
        with pytest.raises(RnnifyError, match=message):
            choose_heads(unloaded, rows, budget="30%", **given)


def test_auto_chooses_again_from_saved_scores(retrieval_model, tmp_path):
    directory, rows = retrieval_model
    model, report = auto_convert(directory, rows, budget="30%", score="mass", **AUTO)
    model.save(tmp_path / "m")
    again = auto(directory, rows, budget="30%", score="mass", scores_from=tmp_path / "m" / "head_map.json")
    assert again.scores == report.scores and again.retrieval == report.retrieval == [(0, 1)]
    assert again.calibration_kl == pytest.approx(report.calibration_kl, rel=1e-5)
    assert again.calibration["scores_from"] == str(tmp_path / "m" / "head_map.json")
    saved = json.loads((tmp_path / "m" / "head_map.json").read_text())
    for change, message in (
        (
            {"window": 8},
            "8-token window and 1 sinks, on a model of 4 kv heads; for that model, pass --window 8 --sinks 1",
        ),
        ({"scores": {"mass": {"0.0": 1.0}}}, "name 1 kv heads, this model has 4"),
        ({"scores": {"x": 1}}, "not a head_map.json"),
    ):
        (tmp_path / "bad.json").write_text(json.dumps({**saved, **change}))
        with pytest.raises(RnnifyError, match=message):
            auto(directory, rows, budget="30%", score="mass", scores_from=tmp_path / "bad.json")
    with pytest.raises(RnnifyError, match="holds the mass score.*not 'kl'"):
        auto(directory, rows, budget="30%", score="kl", scores_from=tmp_path / "m" / "head_map.json")
    # a score past float's range (OverflowError), nesting past Python's recursion limit (RecursionError)
    for text in ('{"scores": {"mass": {"0.0": 1' + "0" * 400 + "}}}", "[" * 100_000 + "]" * 100_000):
        (tmp_path / "bad.json").write_text(text)
        with pytest.raises(RnnifyError, match="not a head_map.json"):
            auto(directory, rows, budget="30%", score="mass", scores_from=tmp_path / "bad.json")


def test_auto_calibration_rows_default_to_the_models_positions(tiny_model_dir):
    """Rows of 1,024 tokens unless the model has fewer positions (as evaluate's and distill's rows):
    the tiny llama's 128; asked for more explicitly, refused."""
    ids = torch.randint(3, 320, (2, 600), generator=torch.Generator().manual_seed(0))
    scorer = HeadScorer(tiny_model_dir("llama"), ids, score="mass", window=4, sinks=1, calib_rows=1, passkey=0)
    assert scorer.about["tokens"] == 128 and [row.shape[1] for row in scorer.calibration.rows] == [128]
    with pytest.raises(RnnifyError, match="--calib-len 129 is past the model's 128 positions"):
        HeadScorer(
            tiny_model_dir("llama"), ids, score="mass", window=4, sinks=1, calib_len=129, calib_rows=1, passkey=0
        )


def test_auto_unmeetable_budget_names_the_smallest(retrieval_model):
    directory, rows = retrieval_model
    with pytest.raises(RnnifyError, match=r"the smallest state .* is ([\d,]+) bytes") as error:
        auto(directory, rows, budget=1000)
    smallest = int(error.value.args[0].split(" is ")[1].split(" bytes")[0].replace(",", ""))
    report = auto(directory, rows, budget=smallest)  # and that budget is met
    assert report.retrieval == [] and report.state_bytes == smallest


def test_auto_cli_errors(capsys, tmp_path, retrieval_model, tiny_model_dir):
    directory, _ = retrieval_model
    text = tmp_path / "calib.txt"
    text.write_text("def f(x):\n    return x + 1\n" * 200)
    base = [
        "convert",
        directory,
        "--to",
        "auto",
        "--calib-len",
        "32",
        "--calib-passkey",
        "0",
        "-o",
        tmp_path / "o",
        "--no-compile",
    ]
    code, _, err = run(capsys, *base, "--data", text, "--state-budget", "10")
    assert_user_error(code, err, "cannot be met", "give at least that")
    code, _, err = run(capsys, *base, "--state-budget", "30%")
    assert_user_error(code, err, "--data")
    code, _, err = run(capsys, *base, "--data", text)
    assert_user_error(code, err, "--state-budget", "--max-kl")
    code, _, err = run(capsys, *base, "--data", text, "--state-budget", "lots")
    assert_user_error(code, err, "expected bytes")
    for share in ("inf%", "-10%", "nan%"):  # an OverflowError; a negative budget said to be too small
        code, _, err = run(capsys, *base, "--data", text, f"--state-budget={share}")
        assert_user_error(code, err, f"--state-budget '{share}' must be a positive size")
    code, _, err = run(capsys, *base, "--data", text, "--state-budget", "30%", "--calib-len", "1000")
    assert_user_error(code, err, "past the model's 128 positions")
    code, _, err = run(
        capsys, "convert", tiny_model_dir("llama"), "--to", "exact", "--max-kl", "1", "-o", tmp_path / "o"
    )
    assert_user_error(code, err, "--to auto only")
    code, _, err = run(
        capsys, "convert", tiny_model_dir("llama"), "--to", "window", "--retrieval-window", "64", "-o", tmp_path / "o"
    )
    assert_user_error(code, err, "--retrieval-window applies to --to auto only")
    assert not (tmp_path / "o").exists()
    code, _, err = run(capsys, *base, "--data", text, "--state-budget", "30%", "--retrieval-keep", "8")
    assert_user_error(code, err, "--retrieval-keep K needs --retrieval-window N")
    code, out, err = run(
        capsys,
        *base,
        "--data",
        text,
        "--state-budget",
        "30%",
        "--window",
        "4",
        "--retrieval-window",
        "16",
        "--retrieval-keep",
        "8",
        "-o",
        tmp_path / "sel",
    )
    assert code == 0, err
    assert "window 16 + 8 selected" in out.replace("\n", " ")
    code, out, err = run(capsys, *base, "--data", text, "--state-budget", "30%")
    assert code == 0, err
    assert "kv 1" in out and (tmp_path / "o" / "head_map.json").is_file()
    first, second = err.splitlines()[:2]  # the stage that scores, chooses and converts, as it starts and ends
    assert first == "choose heads ..." and second.startswith("choose heads: ") and second.endswith(" s"), err
    code, out, _ = run(capsys, "info", tmp_path / "o")
    layers = json.loads((tmp_path / "o" / "head_map.json").read_text())["layers"]
    assert code == 0 and layers.startswith("0:heads(") and layers in out.replace("\n", "")


def test_auto_rows_too_short_for_the_passkey_prompts_name_calib_len(capsys, tmp_path, tiny_model_dir):
    """Rows too short for a pass-key calibration prompt: the error said only "ask for longer contexts
    than 56"; it names --calib-len and the length that fits (one token less does not, that one
    converts), or, past the model's positions, calibrating on text alone."""
    source = tmp_path / "long"
    shutil.copytree(tiny_model_dir("llama"), source)
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 512}))
    text = tmp_path / "calib.txt"
    text.write_text("def f(x):\n    return x + 1\n" * 200)
    base = ["convert", "--to", "auto", "--data", text, "--state-budget", "30%", "--score", "mass", "--no-compile"]
    code, _, err = run(capsys, *base, source, "--calib-len", "64", "-o", tmp_path / "o")
    assert_user_error(
        code, err, "--calib-len 64 is too short for the pass-key calibration prompts", "--calib-passkey 0"
    )
    fits = int(re.search(r"give --calib-len (\d+) or more", err)[1])
    code, _, err = run(capsys, *base, source, "--calib-len", fits - 1, "-o", tmp_path / "o")
    assert_user_error(code, err, f"--calib-len {fits - 1} is too short", f"give --calib-len {fits} or more")
    assert not (tmp_path / "o").exists()
    code, _, err = run(capsys, *base, source, "--calib-len", fits, "-o", tmp_path / "o")
    assert code == 0, err
    code, _, err = run(capsys, *base, tiny_model_dir("llama"), "--calib-len", "64", "-o", tmp_path / "p")
    assert_user_error(code, err, "--calib-len 64 is too short", "model's 128 positions: give --calib-passkey 0")


def test_auto_cli_memory_makes_the_streaming_heads_hybrids(capsys, tmp_path, retrieval_model):
    directory, _ = retrieval_model
    text = tmp_path / "calib.txt"
    text.write_text("def f(x):\n    return x + 1\n" * 200)
    base = [
        "convert",
        directory,
        "--to",
        "auto",
        "--data",
        text,
        "--state-budget",
        "30%",
        "--calib-len",
        "32",
        "--calib-passkey",
        "0",
        "--window",
        "4",
        "--sinks",
        "1",
    ]
    code, _, err = run(capsys, *base, "--memory", "linear", "--layers", "0:exact", "-o", tmp_path / "bad")
    assert_user_error(code, err, "--window, --sinks, --memory and the memory's cell options", "not --layers")
    code, _, err = run(capsys, *base, "--option", "anneal=4", "-o", tmp_path / "bad")
    assert_user_error(code, err, "anneal apply to the streaming heads' hybrids: give --memory")
    assert not (tmp_path / "bad").exists()
    code, out, err = run(
        capsys,
        *base,
        "--memory",
        "linear",
        "--feature-map",
        "elu",
        "--option",
        "memory_init=0.2",
        "-o",
        tmp_path / "o",
        "--no-compile",
    )
    assert code == 0, err
    assert "hybrid 4 + linear memory (feature_map=elu, memory_init=0.2)" in " ".join(out.split())
    model = rnnify.load(tmp_path / "o")
    assert [p.target for p in model.cells[0].parts] == ["exact", "hybrid"] and model.cells[1].target == "hybrid"
    assert (model.cells[1].options()["feature_map"], model.cells[1].options()["memory_init"]) == ("elu", 0.2)
    saved = json.loads((tmp_path / "o" / "head_map.json").read_text())
    assert (saved["memory"], saved["memory_options"]) == ("linear", {"feature_map": "elu", "memory_init": 0.2})


def test_bench_fills_a_per_head_state_like_the_prefill_it_stands_for(tiny_model_dir):
    from rnnify.bench import fill_state

    model = rnnify.convert(tiny_model_dir("llama"), to="window", layers="0-:heads(1=exact)", window=4, sinks=1)
    filled = fill_state(model, context=50, batch=2, fill_tokens=8)
    _, read = model.prefill(torch.randint(0, 300, (2, 50)))
    assert [t.shape for t in filled.tensors] == [t.shape for t in read.tensors]  # exact parts: 50 random keys
    logits, _ = model.step(torch.tensor([[3], [5]]), filled)
    assert torch.isfinite(logits).all()
