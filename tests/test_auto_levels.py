"""``--to auto --levels``: several kinds per kv head. The greedy against brute force on synthetic
ladders and against the one-kind choice it replaces, the per-kind scores against converted models,
a layer of four kinds converted, saved and loaded, and bad ``--levels`` text."""

from __future__ import annotations

import itertools
import json
import random

import pytest
import torch

import rnnify
from rnnify.auto import HeadScorer, Level, auto_convert, head_costs, layers_spec, parse_levels
from rnnify.auto.choice import choose, plan_options
from rnnify.auto.levels import fill, hull, moves, prefix, retrieval_level, shortest_prefix
from rnnify.cells import CellSpec, HeadSplitCell, build_cell
from rnnify.compiler.plan import parse_layers
from rnnify.errors import RnnifyError
from rnnify.verify import run_checks
from tests.test_cli import assert_user_error, run
from tests.test_heads import LENGTH, retrieval_model  # noqa: F401  (a fixture)

KINDS = "window(window=8),select(window=8,keep=4),exact"
SCORING = {"window": 4, "sinks": 1, "calib_len": LENGTH, "calib_rows": 3, "passkey": 0}


# -- the greedy on synthetic ladders -------------------------------------------------------


def synthetic_ladders(rng: random.Random, units: int, rungs: int) -> list[list[tuple[int, float]]]:
    """Per unit the bottom (0, 0) and ``rungs`` rungs of random bytes and benefit, some of them off
    the hull (a costlier rung worth less)."""
    return [[(0, 0.0)] + [(rng.randint(1, 30), rng.uniform(0, 10)) for _ in range(rungs)] for _ in range(units)]


def brute_force(ladders, budget: int) -> float:
    """The best total benefit of one rung per unit within ``budget`` bytes, by trying every choice."""
    best = 0.0
    for rungs in itertools.product(*(range(len(ladder)) for ladder in ladders)):
        if sum(ladder[r][0] for ladder, r in zip(ladders, rungs)) <= budget:
            best = max(best, sum(ladder[r][1] for ladder, r in zip(ladders, rungs)))
    return best


def totals(ladders, rungs) -> tuple[int, float]:
    return sum(ladder[r][0] for ladder, r in zip(ladders, rungs)), sum(
        ladder[r][1] for ladder, r in zip(ladders, rungs)
    )


def test_hull_keeps_the_rungs_of_falling_benefit_per_byte():
    # by bytes: 10 (5), 15 (9), 20 (6), 40 (14): 15 beats 10 per byte from the bottom, 20 is worth
    # less than 15, and 40 gains 5 for 25 bytes more
    assert hull([(0, 0.0), (10, 5.0), (20, 6.0), (15, 9.0), (40, 14.0)]) == [3, 4]
    assert hull([(0, 0.0), (10, 5.0), (20, 9.0)]) == [1, 2]  # concave already
    assert hull([(0, 0.0), (10, 2.0), (20, 9.0)]) == [2]  # 10 lies under the chord
    assert hull([(0, 0.0), (10, 4.0), (20, 8.0)]) == [1, 2]  # collinear: both steps, the nearer first
    assert hull([(0, 0.0), (10, 0.0), (20, 0.0)]) == [1, 2]  # nothing to gain: taken last, while bytes last
    assert hull([(0, 0.0), (10, -1.0)]) == []  # a loss is never taken


@pytest.mark.parametrize("seed", range(6))
def test_greedy_is_the_brute_force_optimum_where_the_budget_ends_at_a_move(seed):
    rng = random.Random(seed)
    ladders = synthetic_ladders(rng, units=4, rungs=3)
    order = moves(ladders)
    for count in range(len(order) + 1):  # a budget that ends at a move: the relaxation's optimum is whole
        budget = totals(ladders, prefix(order, len(ladders), count))[0]
        rungs = fill(order, len(ladders), lambda r: totals(ladders, r)[0] <= budget)
        assert totals(ladders, rungs)[1] == pytest.approx(brute_force(ladders, budget))
    biggest = max(ladders[unit][high][1] - ladders[unit][low][1] for unit, low, high in order)
    for budget in rng.sample(range(0, 121), 25):  # any budget: within one move of the optimum, never over
        used, gained = totals(ladders, fill(order, len(ladders), lambda r: totals(ladders, r)[0] <= budget))
        best = brute_force(ladders, budget)
        assert used <= budget and best - biggest - 1e-9 <= gained <= best + 1e-9


def test_shortest_prefix_is_the_fewest_moves_that_fit():
    ladders = synthetic_ladders(random.Random(7), units=5, rungs=2)
    order = moves(ladders)
    full = totals(ladders, prefix(order, 5, len(order)))[1]
    for need in (0.1, 0.5, 0.9, 1.0):  # "fits": at least this share of the whole benefit
        rungs = shortest_prefix(order, 5, lambda r: totals(ladders, r)[1] >= need * full)
        count = next(k for k in range(1, len(order) + 1) if totals(ladders, prefix(order, 5, k))[1] >= need * full)
        assert rungs == prefix(order, 5, count)


# -- one kind: today's choice --------------------------------------------------------------

SPECS = {layer: CellSpec(9, 3, 64, 64, 0.125) for layer in range(4)}  # SmolLM2's attention shape, four layers
COSTS = {"context": 2048, "window": 64, "sinks": 4, "dtype": torch.float32}


def one_kind_reference(scores, level, budget=None, kl_of=None, max_kl=None, units=None) -> set:
    """The one-kind choice as ``--to auto`` made it before ``--levels``: units by score per byte,
    each that still fits; or the fewest best-scored units whose KL fits (a bisection)."""
    units = units or [[h] for h in sorted(scores)]
    score = [sum(scores[h] for h in unit) for unit in units]

    def cost(heads):
        return head_costs(SPECS, dict.fromkeys(heads, level), COSTS["context"], 64, 4, torch.float32)

    if budget is not None:
        smallest = cost(set())
        extra = [cost(set(u)) - smallest for u in units]
        chosen: set = set()
        for i in sorted(range(len(units)), key=lambda i: -score[i] / max(extra[i], 1)):
            if cost(chosen | set(units[i])) <= budget:
                chosen |= set(units[i])
        return chosen
    order = sorted(range(len(units)), key=lambda i: -score[i])

    def first(k):
        return {h for i in order[:k] for h in units[i]}

    if kl_of(first(0)) <= max_kl:
        return set()
    low, high = 0, len(units)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if kl_of(first(middle)) <= max_kl else (middle, high)
    return first(high)


@pytest.mark.parametrize(
    "level", [Level("exact"), retrieval_level(512), retrieval_level(256, 256)], ids=lambda level: level.text
)
def test_one_kind_reproduces_the_one_kind_choice(level):
    rng = random.Random(level.text)
    heads = [(layer, h) for layer in range(4) for h in range(3)]
    scores = {h: rng.choice([0.0, rng.random(), rng.random()]) for h in heads}  # zeros among them
    smallest = head_costs(SPECS, {}, **COSTS)
    every = head_costs(SPECS, dict.fromkeys(heads, level), **COSTS)
    by_layer = [[h for h in heads if h[0] == layer] for layer in range(4)]
    for share in (0.0, 0.1, 0.3, 0.55, 0.8, 1.0):
        budget = int(smallest + share * (every - smallest))
        for units in (None, by_layer):
            kinds = choose({h: [scores[h]] for h in heads}, [level], SPECS, budget=budget, units=units, **COSTS)
            assert set(kinds) == one_kind_reference(scores, level, budget=budget, units=units)
            assert set(kinds.values()) <= {level}
            assert head_costs(SPECS, kinds, **COSTS) <= budget

    def kl_of(chosen):  # a KL that falls as heads stop streaming
        return sum(scores[h] for h in heads if h not in chosen)

    for max_kl in (0.0, 0.5, 2.0, 100.0):
        kinds = choose(
            {h: [scores[h]] for h in heads},
            [level],
            SPECS,
            kl_of=lambda kinds: kl_of(set(kinds)),
            max_kl=max_kl,
            given="the test's kind",
            **COSTS,
        )
        assert set(kinds) == one_kind_reference(scores, level, kl_of=kl_of, max_kl=max_kl)


def test_levels_exact_is_the_choice_without_levels(retrieval_model):  # noqa: F811
    directory, rows = retrieval_model
    without, listed = HeadScorer(directory, rows, **SCORING), HeadScorer(directory, rows, levels="exact", **SCORING)
    for budget in ("10%", "30%", "60%"):
        one, other = without.choose(budget, 1024), listed.choose(budget, 1024)
        assert one.retrieval == other.retrieval and one.state_bytes == other.state_bytes
        assert one.kinds == other.kinds


# -- scores per kind -----------------------------------------------------------------------


def kl_against_original(directory, model, rows) -> float:
    """Mean over rows of the mean per-token KL(original || model), from the original's own forward."""
    from transformers import AutoModelForCausalLM

    original = AutoModelForCausalLM.from_pretrained(directory).eval()
    kls = []
    with torch.no_grad():
        for row in rows:
            want = original(input_ids=row[None]).logits[0].float().log_softmax(-1)
            got = model.prefill(row[None])[0][0].float().log_softmax(-1)
            kls.append(float((want.exp() * (want - got)).sum(-1).mean()))
    return sum(kls) / len(kls)


def test_each_kind_scores_what_the_head_loses_as_that_kind(retrieval_model):  # noqa: F811
    """A kind's kl score is the KL of the model with that head alone that kind, every other head
    exact: here against the converted model; the marker head (layer 0, kv 1) loses the marker with
    an 8-token window and keeps it with 4 selected tokens."""
    directory, rows = retrieval_model
    scorer = HeadScorer(directory, rows, levels=KINDS, **SCORING)
    lost = scorer.level_scores["kl"]
    assert set(lost) == {"window(window=8)", "select(window=8,keep=4)", "exact"}
    assert all(value == 0 for value in lost["exact"].values())
    assert lost["window(window=8)"][(0, 1)] > 100 * lost["select(window=8,keep=4)"][(0, 1)]
    for text in ("window(window=8)", "select(window=8,keep=4)"):
        level = Level.from_text(text)
        model = rnnify.convert(directory, to="exact", layers=f"0:heads(1={text})", sinks=1)
        assert model.cells[0].parts[0].target == level.target
        assert lost[text][(0, 1)] == pytest.approx(kl_against_original(directory, model, rows), rel=1e-3, abs=1e-7)
    # mass: the marker head's queries look at the marker; a window of 8 drops it, 4 selected keep it
    mass = scorer.level_scores["mass"]
    assert mass["window(window=8)"][(0, 1)] > 10 * mass["select(window=8,keep=4)"][(0, 1)]
    assert mass["window(window=8)"][(0, 1)] <= scorer.scores["mass"][(0, 1)]  # a longer window loses less


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"policy": "snapkv"},
        {"observation": 2},
        {"pool": 3},
        {"pool": 3, "pooling": "max", "policy": "snapkv"},
    ],
    ids=lambda options: ",".join(f"{k}={v}" for k, v in options.items()) or "mass",
)
def test_what_a_select_kind_reads_is_what_the_select_cell_reads(options):
    """``reads`` replays the select cell's rule on the attention it is given: the softmax of the
    original's scores over what it says each query reads is the cell's own output (its float64
    loop), and the mass score counts the rest."""
    from rnnify.auto.probe import reads
    from rnnify.cells.select import naive_recurrent_select_attn

    gen = torch.Generator().manual_seed(0)
    batch, kv_heads, group, length, dim, sinks = 2, 2, 3, 70, 8, 2
    level = Level("select", (("window", 9), ("keep", 5), ("chunk", 8), *options.items()))
    q = torch.randn(batch, kv_heads, group, length, dim, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(batch, kv_heads, length, dim, generator=gen, dtype=torch.float64) for _ in range(2))
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    logits = torch.einsum("bhgid,bhjd->bhgij", q, k) * dim**-0.5
    p = torch.softmax(logits.masked_fill(~causal, float("-inf")), -1).reshape(batch, kv_heads * group, length, length)
    read = reads(p, sinks, level, group)
    grouped = p.reshape(batch, kv_heads, group, length, length) * read[:, :, None]
    got = (grouped / grouped.sum(-1, keepdim=True)) @ v[:, :, None]
    cell = build_cell("select", CellSpec(kv_heads * group, kv_heads, dim, dim, dim**-0.5), level.cell_options(sinks))
    state = tuple(t.double() if t.is_floating_point() else t for t in cell.init_state(batch, "cpu", torch.float64))
    mask = torch.ones(batch, length, dtype=torch.bool)
    want, *_ = naive_recurrent_select_attn(q, k, v, mask, *state, scale=dim**-0.5, rule=cell.rule)
    torch.testing.assert_close(got, want)
    window = reads(p, sinks, Level("window", (("window", 9),)), group)
    assert bool((read >= window).all()) and bool((read & ~window).any())  # the window and what it selects


# -- the choice, converted -----------------------------------------------------------------


@pytest.fixture(scope="module")
def four_kv_heads(tmp_path_factory):
    """A tiny random Llama with 4 kv heads per layer (2 layers), and calibration rows."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.conftest import make_tiny

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=8,
        max_position_embeddings=128,
        vocab_size=320,
        bos_token_id=0,
        eos_token_id=0,
    )
    directory = tmp_path_factory.mktemp("four-kv")
    LlamaForCausalLM(config).save_pretrained(directory)
    make_tiny.train_tokenizer().save_pretrained(directory)
    return directory, torch.randint(3, 320, (2, 48), generator=torch.Generator().manual_seed(0))


def test_four_kinds_in_one_layer_convert_step_like_the_prefill_and_load(four_kv_heads, tmp_path):
    directory, _ = four_kv_heads
    specs = {layer: CellSpec(8, 4, 8, 8, 8**-0.5) for layer in range(2)}
    kinds = {(0, 3): Level("exact"), (0, 0): Level.from_text("window(window=16)")}
    kinds |= {(0, 2): Level.from_text("select(window=8,keep=8)"), (1, 1): Level("exact")}
    spec = layers_spec(specs, kinds)  # layer 0: kv 1 streams, the other three each their kind
    assert spec == "0:heads(0=window(window=16);2=select(window=8,keep=8);3=exact),1:heads(1=exact)"
    target, options = plan_options(kinds, 8, 4, 1)
    model = rnnify.convert(directory, to=target, layers=spec, **options)
    layer0 = model.cells[0]
    assert [(p.target, kv) for p, kv in zip(layer0.parts, layer0.kv_heads)] == [
        ("window", [0]),
        ("select", [2]),
        ("exact", [3]),
        ("window", [1]),
    ]
    assert [p.options()["window"] for p in layer0.parts if p.target != "exact"] == [16, 8, 4]
    assert model.state_nbytes(100) == head_costs(specs, kinds, 100, 4, 1, torch.float32)
    checks = {r.name: r for r in run_checks(model, tokens=40)}  # past the windows: selection decides
    assert checks["step == prefill"].passed and checks["split prefill"].passed
    model.save(tmp_path / "m")
    loaded = rnnify.load(tmp_path / "m")
    ids = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(1))
    assert torch.equal(loaded.prefill(ids)[0], model.prefill(ids)[0])


@pytest.mark.parametrize(
    "listed",
    [
        ["window(window=16)", "select(window=8,keep=8)", "exact"],
        ['lola(window=8,keep=8,feature_map="elu")', "exact"],
    ],
    ids=["select", "lola"],
)
def test_the_report_is_the_converted_model_and_its_calibration_kl(four_kv_heads, tmp_path, listed):
    """The kinds chosen are the converted model's cells, and the KL the probe measured for that
    choice is the converted model's: for a lola kind (the selection cache with an elu memory of the
    rest) the probe runs the lola cell itself on the head's queries, keys and values."""
    directory, rows = four_kv_heads
    scoring = {**SCORING, "calib_len": 48, "calib_rows": 2}
    levels = ",".join(listed)
    model, report = auto_convert(directory, rows, levels=levels, budget="50%", context=64, **scoring)
    assert report.levels == listed  # cheapest first at 64
    assert len(set(report.kinds.values())) >= 3  # this budget mixes kinds
    for (layer, head), text in ((tuple(map(int, k.split("."))), v) for k, v in report.kinds.items()):
        cell = model.cells[layer]
        parts = cell.parts if isinstance(cell, HeadSplitCell) else [cell]
        kvs = cell.kv_heads if isinstance(cell, HeadSplitCell) else [list(range(4))]
        part = next(p for p, kv in zip(parts, kvs) if head in kv)
        want = Level("window", (("window", 4),)) if text == "streaming" else Level.from_text(text)
        assert part.target == want.target
        assert all(part.options()[k] == v for k, v in want.cell_options(1).items())
    kept = [tuple(map(int, k.split("."))) for k, v in report.kinds.items() if v != "streaming"]
    assert report.retrieval == sorted(kept)
    assert report.state_bytes == model.state_nbytes(64) <= 0.5 * report.kv_cache_bytes
    assert report.calibration_kl == pytest.approx(kl_against_original(directory, model, rows), rel=1e-3, abs=1e-7)
    assert json.loads(model.files["head_map.json"])["kinds"] == report.kinds
    # the bound: the shortest prefix of the same moves whose KL fits
    bound = 0.5 * report.calibration_kl
    scorer = HeadScorer(directory, rows, levels=levels, scores_from=_saved(model, tmp_path), **scoring)
    tight = scorer.choose(max_kl=bound, context=64)
    assert tight.calibration_kl <= bound
    again = scorer.choose(budget="50%", context=64)
    assert again.kinds == report.kinds and again.level_scores == report.level_scores


def _saved(model, tmp_path):
    model.save(tmp_path / "m")
    return tmp_path / "m" / "head_map.json"


def test_retrieval_head_gets_the_cheapest_kind_that_keeps_the_marker(retrieval_model, tmp_path):  # noqa: F811
    directory, rows = retrieval_model
    scorer = HeadScorer(directory, rows, levels=KINDS, **SCORING)
    report = scorer.choose(max_kl=1e-3, context=1024)  # the first move: nearly all of exact's gain, few bytes
    assert report.retrieval == [(0, 1)] and report.kinds["0.1"] == "select(window=8,keep=4)"
    assert report.calibration_kl < 1e-3 < scorer.kl_of({})
    roomy = scorer.choose("30%", 1024)  # bytes to spare: exact gains the rest of the marker head's loss
    assert roomy.kinds["0.1"] == "exact" and roomy.state_bytes <= 0.3 * roomy.kv_cache_bytes
    # an earlier head_map.json without kinds' scores chooses one kind again, but not several
    model, old = auto_convert(directory, rows, budget="30%", context=1024, **SCORING)
    saved = json.loads(model.files["head_map.json"])
    for field in ("levels", "level_scores", "kinds"):
        del saved[field]
    (tmp_path / "old.json").write_text(json.dumps(saved))
    again = HeadScorer(directory, rows, scores_from=tmp_path / "old.json", **SCORING).choose("30%", 1024)
    assert again.retrieval == old.retrieval == [(0, 1)]
    with pytest.raises(RnnifyError, match=r"holds no kl scores for window\(window=8\), select"):
        HeadScorer(directory, rows, levels=KINDS, scores_from=tmp_path / "old.json", **SCORING)


# -- bad --levels --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, message",
    [
        ("linear", "'linear' is not a kind"),
        ("", "'' is not a kind"),
        ("window", "a window kind takes one option"),
        ("window(window=4)", "not longer than the streaming heads' 4-token window"),
        ("window(window=16", "expected window(KEY=VALUE,...)"),
        ("window(length=16)", "a window kind takes one option"),
        ("select(window=8)", "select(window=N,keep=K)"),
        ("select(window=8,keep=-1)", "keep"),
        ("select(window=8,keep=4,policy=bogus)", "policy must be one of"),
        ("select(window=8,keep=4,sinks=2)", "keeps the --sinks sinks"),
        ('select(window=8,keep=4,kv_dtype="int8")', "a kind takes no kv_dtype"),
        ("exact(window=8)", "exact takes no options"),
        ("exact,window(window=16),exact", "exact is listed twice"),
        ("window(window=16),select(window=8,keep=4)x", "expected select(KEY=VALUE,...)"),
        ("window(16)", "option '16' of window: expected KEY=VALUE"),
        ("lola(window=8)", "lola(window=N,keep=K)"),
        ("lola(window=8,keep=4,feature_map=bogus)", "feature"),
    ],
)
def test_bad_levels_are_one_clear_line(text, message):
    with pytest.raises(RnnifyError, match=message.replace("(", r"\(").replace(")", r"\)")) as error:
        parse_levels(text, window=4)
    assert "\n" not in str(error.value) and str(error.value).startswith(f"--levels {text!r}: ")


def test_a_lola_kind_is_scored_by_kl_only(retrieval_model):  # noqa: F811
    """The mass score counts the attention a kind does not read; a memory reads every token."""
    directory, rows = retrieval_model
    with pytest.raises(RnnifyError, match="score lola kinds with --score kl"):
        HeadScorer(directory, rows, score="mass", levels="lola(window=8,keep=4,feature_map=elu)", **SCORING)


def test_levels_on_the_command_line(capsys, tmp_path, retrieval_model):  # noqa: F811
    directory, _ = retrieval_model
    text = tmp_path / "calib.txt"
    text.write_text("def f(x):\n    return x + 1\n" * 200)
    base = ["convert", directory, "--to", "auto", "--data", text, "--state-budget", "30%", "--calib-len", "32"]
    base += ["--calib-passkey", "0", "--window", "4", "--sinks", "1", "--no-compile"]
    for bad, words in (
        (["--levels", "linear"], ("--levels 'linear'", "not a kind")),
        (["--levels", "window(window=2)"], ("not longer than the streaming heads' 4-token window",)),
        (["--levels", "exact", "--retrieval-window", "8"], ("--levels lists every kind",)),
    ):
        code, _, err = run(capsys, *base, *bad, "-o", tmp_path / "bad")
        assert_user_error(code, err, *words)
    assert not (tmp_path / "bad").exists()
    code, out, err = run(capsys, *base, "--levels", KINDS, "-o", tmp_path / "o")
    assert code == 0, err
    saved = json.loads((tmp_path / "o" / "head_map.json").read_text())
    counts = {
        name: list(saved["kinds"].values()).count(kind)
        for kind, name in (
            ("exact", "exact"),
            ("select(window=8,keep=4)", "window 8 + 4 selected"),
            ("window(window=8)", "window 8"),
            ("streaming", "window 4"),
        )
    }
    summary = " ".join(out.split())
    assert "kv heads: " + ", ".join(f"{n} {name}" for name, n in counts.items()) + "; attention state" in summary
    assert sum(counts.values()) == 4
    assert rnnify.load(tmp_path / "o").manifest.layers == [str(rule) for rule in parse_layers(saved["layers"])]
