"""rnnify's vLLM plugin (rnnify.integrations.vllm): vLLM gives rnnify's own greedy tokens, log-probs and text.

Skipped unless vLLM imports (it is not a dependency: docs/serving.md says how to install it).

``vllm.LLM`` runs in a script of its own (under the ``if __name__ == "__main__":`` guard vLLM's
spawned processes need), in a subprocess that prints its results as JSON: one script runs every
target in turn, with vLLM's engine and model in the script's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
executor ``uni``), where an engine starts in about 3 s instead of 20 (2 cores) and the plugin runs
the same code. The OpenAI-compatible server keeps vLLM's default layout, an engine process and a
worker process that each load the plugin; it runs once for the module, driven by the official
``openai`` client (a dependency of vLLM's).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

import rnnify
from rnnify.errors import RnnifyError
from rnnify.integrations.vllm.hosting import check_hostable
from rnnify.runtime.agreement import tolerance

ROOT = Path(__file__).resolve().parents[1]
BUNDLED = ROOT / "examples" / "models" / "stdlib-llama"
# a one-token prompt (decoded with the batched step from a fresh slot), a short one, and one longer
# than the windows (8 and 16), so a window's ring buffer wraps during prefill
PROMPTS = [
    "The",
    "def main(",
    "import os\nimport sys\n\nclass Config:\n    def __init__(self, path):\n        self.path = path\n",
]
NEW_TOKENS = 16
# every target family that the bundled model (4 layers, 2 kv heads) converts to, a per-head split
# (layer 0's kv head 0 a window of 8, its head 1 linear; layer 1 linear; layers 2-3 the --to window
# of 16), and exact attention in vLLM's pages: whole (``exact``), beside state slots (layer 0
# exact, layer 1's kv head 0 exact and head 1 linear, layers 2-3 windows), and in pages of one kv head
TARGETS = {
    "exact": dict(to="exact"),
    "exact-mixed": dict(to="window", window=16, layers="0:exact,1:heads(0=exact;1=linear)"),
    # exact kv head 0 alone in each layer: vLLM's pages hold one kv head, not the model's two
    "exact-heads": dict(to="window", window=16, layers="0:heads(0=exact;1=linear),1:heads(0=exact;1=window(window=8))"),
    "window": dict(to="window", window=16),
    "window-int8": dict(to="window", window=16, kv_dtype="int8"),  # int8 slots in the state's pages
    # a selection cache in int8: its scores (fp32) and positions (int64) in the pages too
    "select-int8": dict(to="select", window=8, sinks=2, keep=4, chunk=4, kv_dtype="int8"),
    "linear": dict(to="linear"),
    "gated": dict(to="gated"),
    "delta": dict(to="delta"),
    "hybrid": dict(to="hybrid", window=8),
    "gated-delta": dict(to="gated-delta"),
    "aaren": dict(to="aaren"),
    "heads": dict(to="window", window=16, layers="0:heads(0=window(window=8);1=linear),1:linear"),
}
# and a model with its own sliding window (the tiny Mistral's 16), converted to ``exact``: its keys
# and values in vLLM's pages too, the window applied as the model does
SLIDING = "exact-sliding"
NAMES = [*TARGETS, SLIDING]
# new tokens of each sequence in the run whose pages run out: past the first 128-token block
PREEMPTED_TOKENS = 140
# the tiny Mistral with 2,048 positions: sequences far past its 16-token window in 8 blocks
SLIDING_PAGES = {"num_gpu_blocks_override": 8, "max_model_len": 704, "max_num_batched_tokens": 128}
SLIDING_TOKENS = 600
# vLLM's chunked prefill: at most 16 tokens a step, two sequences at a time
CHUNKED = {"max_num_seqs": 2, "max_num_batched_tokens": 16, "max_model_len": 256}
CHUNKED_PROMPTS = PROMPTS + [
    "for i in range(10):\n    print(i)\n",
    "x",
    "class A:\n    pass\n\n\nclass B(A):\n    def f(self):",
]
# a chat template of our own: the bundled tokenizer has none
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

SCRIPT = textwrap.dedent('''
    import gc, json, sys, time

    if __name__ == "__main__":
        runs = json.loads(sys.argv[1])
        import torch
        from vllm import LLM, SamplingParams
        import rnnify

        models, greedy = {}, {}

        def rnnify_greedy(path, prompt_ids, new):
            """rnnify's greedy tokens (generate) and their log-probs, read from the same prefill
            and steps generate runs; once per model and prompt (a shorter run takes a prefix)."""
            key = (path, tuple(prompt_ids))
            if key in greedy and len(greedy[key][0]) >= new:
                return greedy[key][0][:new], greedy[key][1][:new]
            if path not in models:
                models[path] = rnnify.load(path)
            model = models[path]
            ids = torch.tensor([prompt_ids])
            tokens = model.generate(ids, max_new_tokens=new)[0, ids.shape[1]:].tolist()
            logprobs = []
            with torch.inference_mode():
                logits, state = model.prefill(ids)
                for token in tokens:
                    logprobs.append(float(torch.log_softmax(logits[0, -1].float(), dim=-1)[token]))
                    logits, state = model.step(torch.tensor([[token]]), state)
            greedy[key] = tokens, logprobs
            return tokens, logprobs

        def rnnify_prompt_logprobs(path, prompt_ids):
            """rnnify's log-prob of each prompt token after the first, from one prefill."""
            with torch.inference_mode():
                logits, _ = models[path].prefill(torch.tensor([prompt_ids]))
            scores = torch.log_softmax(logits[0, :-1].float(), dim=-1)
            return scores.gather(1, torch.tensor(prompt_ids[1:])[:, None])[:, 0].tolist()

        from vllm.v1.core.sched.scheduler import Scheduler

        preempted = [0]  # vLLM's preemptions so far (its scheduler runs in this process)
        preempt = Scheduler._preempt_request

        def counted(self, *args, **kwargs):
            preempted[0] += 1
            return preempt(self, *args, **kwargs)

        Scheduler._preempt_request = counted
        report = {}
        for run in runs:
            preempted[0] = 0
            started = time.perf_counter()
            llm = LLM(run["path"], enforce_eager=True, **run["engine"])
            if run.get("original"):  # vLLM serving the source model itself: its tokens and log-probs only
                sampling = SamplingParams(temperature=0, **run["sampling"])
                results = []
                for batch in run["batches"]:
                    for out in llm.generate(batch, sampling):
                        got = list(out.outputs[0].token_ids)
                        logprobs = [step[t].logprob for step, t in zip(out.outputs[0].logprobs, got)]
                        results.append(dict(prompt=out.prompt, got=got, got_logprobs=logprobs))
                llm.llm_engine.engine_core.shutdown()
                del llm
                gc.collect()
                report[run["name"]] = dict(results=results)
                continue
            startup = time.perf_counter() - started
            sampling = SamplingParams(temperature=0, **run["sampling"])
            results = []
            for batch in run["batches"]:
                for out in llm.generate(batch, sampling):
                    got = list(out.outputs[0].token_ids)
                    got_logprobs = None
                    if out.outputs[0].logprobs is not None:
                        got_logprobs = [step[t].logprob for step, t in zip(out.outputs[0].logprobs, got)]
                    want, want_logprobs = rnnify_greedy(run["path"], out.prompt_token_ids, run["sampling"]["max_tokens"])
                    prompt = dict(got_prompt_logprobs=None, want_prompt_logprobs=None)
                    if out.prompt_logprobs is not None:
                        ids = out.prompt_token_ids
                        prompt = dict(got_prompt_logprobs=[step[t].logprob for step, t in zip(out.prompt_logprobs[1:], ids[1:])],
                                      want_prompt_logprobs=rnnify_prompt_logprobs(run["path"], ids))
                    results.append(dict(prompt=out.prompt, batch=len(batch), got=got, want=want,
                                        got_logprobs=got_logprobs, want_logprobs=want_logprobs, **prompt))
            llm.llm_engine.engine_core.shutdown()  # the engine (and its processes) go before the next starts
            del llm
            gc.collect()
            model = models[run["path"]]
            report[run["name"]] = dict(results=results, eos=model.tokenizer.eos_token_id, dtype=str(model.dtype),
                                       startup=startup, seconds=time.perf_counter() - started, preempted=preempted[0])
        print("RESULTS " + json.dumps(report))
''')


# the key of run_vllm's report that holds what the process printed (vLLM's log)
LOG = "log"


def vllm_env(**extra: str) -> dict:
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", **extra)
    env.pop("TRITON_INTERPRET", None)  # conftest's, for rnnify's kernel tests; vLLM would take it as a Triton backend
    return env


def run_vllm(tmp_path: Path, runs: list[dict]) -> dict:
    """Each run (name, path, engine, sampling, batches: lists of prompts) through ``vllm.LLM``, with
    rnnify's greedy tokens and log-probs for the same prompt ids; the results by run name, and under
    ``LOG`` what the process printed. vLLM's engine and model run in the script's own process."""
    runs = [dict(run, engine=dict(run["engine"], distributed_executor_backend="uni")) for run in runs]
    report, log = run_script(tmp_path / "run_vllm.py", SCRIPT, [json.dumps(runs)], timeout=900)
    return {**report, LOG: log}


def run_script(script: Path, source: str, argv: list[str], timeout: int) -> tuple[dict, str]:
    """Run ``source`` as ``script`` with vLLM's engine in its process; the JSON it prints after
    ``RESULTS``, and all it printed."""
    script.write_text(source)
    proc = subprocess.run(
        [sys.executable, str(script), *argv],
        capture_output=True,
        text=True,
        env=vllm_env(VLLM_ENABLE_V1_MULTIPROCESSING="0"),
        timeout=timeout,
        check=False,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULTS ")]
    assert proc.returncode == 0 and lines, f"vLLM run failed (rc {proc.returncode}):\n{proc.stderr[-6000:]}"
    return json.loads(lines[-1][len("RESULTS ") :]), proc.stdout + proc.stderr


def assert_same_tokens(result: dict, max_tokens: int, ignore_eos: bool) -> None:
    """vLLM's tokens are rnnify's, token by token; vLLM stops early only on the end-of-sequence id."""
    eos = result["eos"]
    for row in result["results"]:
        got, want = row["got"], row["want"]
        for i, (a, b) in enumerate(zip(got, want)):
            assert a == b, f"prompt {row['prompt']!r}: token {i} is {a} in vLLM, {b} in rnnify ({got} vs {want})"
        if ignore_eos or not got or got[-1] != eos:
            assert len(got) == max_tokens, f"prompt {row['prompt']!r}: vLLM gave {len(got)} tokens: {got}"


def assert_same_logprobs(result: dict, prompt: bool) -> None:
    """vLLM's log-prob of each greedy token (``prompt``: of each prompt token after the first) is
    rnnify's within ``tolerance(dtype)`` of rnnify's magnitude, with a floor of one nat."""
    limit = tolerance(getattr(torch, result["dtype"].removeprefix("torch.")))
    kind = "prompt_logprobs" if prompt else "logprobs"
    for row in result["results"]:
        got, want = row[f"got_{kind}"], row[f"want_{kind}"]
        assert got is not None and len(got) == (len(want) if prompt else len(row["got"]))
        for i, (a, b) in enumerate(zip(got, want)):
            assert abs(a - b) <= limit * max(1.0, abs(b)), (
                f"prompt {row['prompt']!r}: log-prob of {'prompt ' if prompt else ''}token {i + prompt} is {a} "
                f"in vLLM, {b} in rnnify"
            )


@pytest.fixture(scope="module")
def converted(tmp_path_factory, tiny_model_dir) -> dict[str, Path]:
    """The bundled model converted to each of TARGETS, and the tiny Mistral to ``exact`` (SLIDING)."""
    root = tmp_path_factory.mktemp("vllm")
    dirs = {}
    for name, options in TARGETS.items():
        dirs[name] = root / name
        rnnify.convert(str(BUNDLED), **options).save(dirs[name])
    dirs[SLIDING] = root / SLIDING
    rnnify.convert(str(tiny_model_dir("mistral")), to="exact").save(dirs[SLIDING])
    return dirs


@pytest.fixture(scope="module")
def sliding_long(tmp_path_factory, tiny_model_dir) -> Path:
    """The tiny Mistral (a 16-token sliding window) with 2,048 positions, converted to ``exact``."""
    source = tmp_path_factory.mktemp("mistral-long") / "source"
    shutil.copytree(tiny_model_dir("mistral"), source)
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 2048}))
    out = source.parent / "converted"
    rnnify.convert(str(source), to="exact").save(out)
    return out


@pytest.fixture(scope="module")
def equivalence(converted, sliding_long, tmp_path_factory) -> dict:
    """One vLLM subprocess over every target: each prompt alone, then all three together (one
    prefill each, then batched steps), greedy with the log-prob of each chosen token and of each
    prompt token; vLLM serving the source model itself (``original``); ``exact`` with 16 blocks of
    pages for three sequences of 140 new tokens, so vLLM preempts some and reads them again
    (``exact-preempted``); then, as
    ``NAME-chunked``, with a 16-token budget and two sequences at a time: a long prompt is read in
    chunks that continue from the stored state, and later prompts take slots that finished ones
    left. ``window`` runs more prompts there, twice (the second time in reverse order), so a second
    call finds no state left from the first."""
    sampling = {"max_tokens": NEW_TOKENS, "logprobs": 1, "prompt_logprobs": 0}
    runs = [
        dict(name=name, path=str(path), engine={}, sampling=sampling, batches=[[p] for p in PROMPTS] + [PROMPTS])
        for name, path in converted.items()
    ]
    # the source model through vLLM's own attention, in the float32 it and its conversions hold
    runs.append(
        dict(
            name="original",
            path=str(BUNDLED),
            original=True,
            engine={"dtype": "float32"},
            sampling={"max_tokens": NEW_TOKENS, "logprobs": 1},
            batches=[PROMPTS],
        )
    )
    runs.append(
        dict(name="exact-preempted", path=str(converted["exact"]), batches=[PROMPTS],
             engine={"num_gpu_blocks_override": 16, "max_model_len": 256},
             sampling={"max_tokens": PREEMPTED_TOKENS, "ignore_eos": True})
    )  # fmt: skip
    runs.append(
        dict(name="sliding-pages", path=str(sliding_long), batches=[PROMPTS], engine=SLIDING_PAGES,
             sampling={"max_tokens": SLIDING_TOKENS, "ignore_eos": True})
    )  # fmt: skip
    for name, path in converted.items():
        batches = [CHUNKED_PROMPTS, CHUNKED_PROMPTS[::-1]] if name == "window" else [PROMPTS]
        sampling = {"max_tokens": 12, "ignore_eos": True, "prompt_logprobs": 0}
        runs.append(dict(name=f"{name}-chunked", path=str(path), engine=CHUNKED, sampling=sampling, batches=batches))
    return run_vllm(tmp_path_factory.mktemp("vllm-run"), runs)


@pytest.mark.parametrize("target", NAMES)
def test_greedy_equals_rnnify_generate(equivalence, target):
    result = equivalence[target]
    assert len(result["results"]) == 2 * len(PROMPTS)
    assert {row["batch"] for row in result["results"]} == {1, len(PROMPTS)}
    assert_same_tokens(result, NEW_TOKENS, ignore_eos=False)


@pytest.mark.parametrize("target", NAMES)
def test_chunked_prefill_and_reused_slots(equivalence, target):
    result = equivalence[f"{target}-chunked"]
    prompts = CHUNKED_PROMPTS if target == "window" else PROMPTS
    assert len(result["results"]) == (2 if target == "window" else 1) * len(prompts)
    assert_same_tokens(result, 12, ignore_eos=True)


@pytest.mark.parametrize("target", NAMES)
def test_logprobs_equal_rnnify_log_softmax(equivalence, target):
    """vLLM's log-prob of each greedy token (its sampler's log-softmax of the logits the plugin hands
    it) is rnnify's, within ``tolerance(dtype)`` of rnnify's magnitude with a floor of one nat:
    ``|vllm - rnnify| <= tolerance * max(1, |rnnify|)`` (float32: 1e-4 nats, or 1e-4 of a log-prob below -1)."""
    assert_same_logprobs(equivalence[target], prompt=False)


@pytest.mark.parametrize("target", NAMES)
@pytest.mark.parametrize("run", ["whole", "chunked"])
def test_prompt_logprobs_equal_rnnify_log_softmax(equivalence, target, run):
    """Prompt log-probs read the logits of every prompt position, where decoding reads only the last:
    the plugin's rows of a prompt are hidden states and its head runs on whichever rows vLLM asks for
    (rnnify/integrations/vllm/model.py); in chunks of 16 tokens, a chunk of one token is a step whose
    logits its row refers to. Each equals rnnify's prefill of the whole prompt, within the same limit
    as above."""
    result = equivalence[target if run == "whole" else f"{target}-chunked"]
    assert max(len(row["want_prompt_logprobs"]) for row in result["results"]) > 10
    assert_same_logprobs(result, prompt=True)


def test_the_plugin_logs_through_vllms_logger(equivalence):
    """The plugin's lines pass through vLLM's handler, in its format: here the dtype a model runs in
    where vLLM chose another (its CPU default); and vLLM's CPU platform does not take the model for
    a Mamba backend of its own (where the CPU has AVX-512 BF16 it warned that it reset the states'
    dtype for "GDN backend 'rnnify'", a setting the plugin's states never read)."""
    log = equivalence[LOG]
    if torch.cpu._is_avx512_bf16_supported():  # where vLLM's CPU platform checks the states' dtype at all
        assert "backend 'none'" in log  # its warning all the same for the source model's run
        assert "backend 'rnnify'" not in log
    assert re.search(
        r"INFO .*rnnify: the model runs in float32, the dtype it was converted to, not vLLM's bfloat16", log
    )


def test_exact_equals_vllm_serving_the_original(equivalence):
    """``exact`` through the plugin (vLLM's pages, rnnify's attention) gives the tokens of vLLM
    serving the source model with its own attention, and their log-probs within the tolerance."""
    original = {row["prompt"]: row for row in equivalence["original"]["results"]}
    rows = [row for row in equivalence["exact"]["results"] if row["batch"] == len(PROMPTS)]
    assert {row["prompt"] for row in rows} == set(original) == set(PROMPTS)
    rel = tolerance(torch.float32)
    for row in rows:
        want = original[row["prompt"]]
        assert row["got"] == want["got"], f"prompt {row['prompt']!r}: {row['got']} vs vLLM's {want['got']}"
        for got, ref in zip(row["got_logprobs"], want["got_logprobs"]):
            assert abs(got - ref) <= rel * max(1.0, abs(ref)), (row["prompt"], got, ref)


def test_a_models_own_window_frees_its_pages(equivalence):
    """An exact site with the model's own sliding window is paged as a sliding window: vLLM frees the
    blocks that fall out of it, so three sequences of 600 new tokens run in 8 blocks
    (with pages kept for every token, vLLM refuses to start: one 704-token sequence does not fit),
    and give ``rnnify generate``'s tokens."""
    assert_same_tokens(equivalence["sliding-pages"], SLIDING_TOKENS, ignore_eos=True)


def test_preempted_sequences_are_read_again(equivalence):
    """Sequences that vLLM preempts when its pages run out (their blocks and state slots freed) are
    read again from their tokens when resumed, and give ``rnnify generate``'s tokens."""
    result = equivalence["exact-preempted"]
    assert result["preempted"] > 0
    assert_same_tokens(result, PREEMPTED_TOKENS, ignore_eos=True)


# tiny hybrids whose own recurrent layers vLLM holds in state slots beside exact attention's pages
HYBRIDS = {
    "recurrent_gemma": dict(  # RG-LRU and short convolutions, then local attention over 16 tokens
        num_hidden_layers=3, hidden_size=32, intermediate_size=64, lru_width=32, head_dim=8, attention_window_size=16
    ),
    "zaya": dict(  # a chain of convolutions and a token shift inside attention, a sliding layer of 8
        num_hidden_layers=2, hidden_size=64, head_dim=16, moe_intermediate_size=32, num_experts=4,
        num_experts_per_tok=1, layer_types=["hybrid", "hybrid_sliding"], sliding_window=8, cca_time0=3, cca_time1=2,
    ),
    "minimax": dict(  # lightning attention around softmax attention, the source's blocks of 16 tokens
        num_hidden_layers=3, hidden_size=32, intermediate_size=64, head_dim=8, block_size=16, num_local_experts=2,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
    ),
}  # fmt: skip


# tiny models whose attention adds terms of its own to its scores, which the paged attention adds as
# rnnify's attention does: learned sink logits (gpt-oss, its first layer sliding over 8 tokens), logit
# softcapping (Gemma 2, its weights large enough that scores reach the cap) and ALiBi (BLOOM, whose config
# names its heads n_head: vLLM reads the sizes by their common names, its pages' from the exact sites)
SCORED = {
    "gpt_oss": dict(
        num_hidden_layers=2, hidden_size=64, intermediate_size=64, head_dim=16, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
    ),
    "gemma2": dict(
        num_hidden_layers=2, hidden_size=64, intermediate_size=128, head_dim=16, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"], attn_logit_softcapping=4.0, initializer_range=0.3,
    ),
    "bloom": dict(n_layer=2, hidden_size=64),
}  # fmt: skip


def serve_tiny_models(tmp_path_factory, models: dict[str, dict]) -> dict:
    """Each of ``models`` (model type: its config), random, with the bundled model's tokenizer,
    converted to ``exact`` and served: each prompt alone, then all together (``NAME``), and with a
    16-token budget (``NAME-chunked``)."""
    from support import tiny_causal_lm

    config = json.loads((BUNDLED / "config.json").read_text())
    tokens = {key: config[key] for key in ("vocab_size", "bos_token_id", "eos_token_id")}
    runs = []
    for name, sizes in models.items():
        source = tmp_path_factory.mktemp(name) / "source"
        common = dict(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0)
        tiny_causal_lm(name, **tokens, **common, **sizes).save_pretrained(source)
        for file in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(BUNDLED / file, source)
        out = source.parent / "exact"
        rnnify.convert(str(source), to="exact").save(out)
        sampling = {"max_tokens": 12, "ignore_eos": True, "logprobs": 1, "prompt_logprobs": 0}
        batches = [[p] for p in PROMPTS] + [PROMPTS]
        runs.append(dict(name=name, path=str(out), engine={}, sampling=sampling, batches=batches))
        runs.append(dict(name=f"{name}-chunked", path=str(out), engine=CHUNKED, sampling=sampling, batches=[PROMPTS]))
    return run_vllm(tmp_path_factory.mktemp("vllm-tiny"), runs)


@pytest.fixture(scope="module")
def hybrids(tmp_path_factory) -> dict:
    """HYBRIDS served (``serve_tiny_models``)."""
    return serve_tiny_models(tmp_path_factory, HYBRIDS)


@pytest.fixture(scope="module")
def scored(tmp_path_factory) -> dict:
    """SCORED served (``serve_tiny_models``)."""
    return serve_tiny_models(tmp_path_factory, SCORED)


@pytest.mark.parametrize("run", [f"{name}{suffix}" for name in SCORED for suffix in ("", "-chunked")])
def test_score_terms_are_served(scored, run):
    """Sink logits, softcapping and ALiBi in vLLM's pages, read in one prefill or in chunks, alone or
    batched: vLLM's tokens and the log-probs of every prompt and greedy token are rnnify's."""
    assert_same_tokens(scored[run], 12, ignore_eos=True)
    assert_same_logprobs(scored[run], prompt=False)
    assert_same_logprobs(scored[run], prompt=True)


@pytest.mark.parametrize("run", [f"{name}{suffix}" for name in HYBRIDS for suffix in ("", "-chunked")])
def test_hybrids_own_layers_are_served(hybrids, run):
    """A model's own layers (RG-LRU, convolutions, a token shift, lightning attention) keep their state
    in vLLM's slots, read in one prefill or in chunks, alone or batched: vLLM's tokens and the
    log-probs of every prompt and greedy token are rnnify's."""
    assert_same_tokens(hybrids[run], 12, ignore_eos=True)
    assert_same_logprobs(hybrids[run], prompt=False)
    assert_same_logprobs(hybrids[run], prompt=True)


def test_decode_rows_are_grouped_by_length():
    """Decoding sequences are read in groups that left-pad to at most twice their own length, each
    sequence in exactly one: one long context beside short ones is not copied at its length for all."""
    from rnnify.integrations.vllm.paged import _similar_lengths

    lengths = [5, 9000, 7, 6, 40, 8200, 33]
    groups = _similar_lengths(lengths)
    assert sorted(i for group in groups for i in group) == list(range(len(lengths)))
    for group in groups:
        assert max(lengths[i] for i in group) * len(group) <= 2 * sum(lengths[i] for i in group)
    assert len(groups) == 3  # the short ones, the two long ones, and 40 and 33 apart from both
    assert _similar_lengths([12, 12, 12]) == [[0, 1, 2]]


def test_unhostable_exact_is_refused(tmp_path):
    """An exact attention that vLLM's pages cannot hold (pages narrower than its heads) is refused
    with one line naming the target, before any weight is read."""
    out = tmp_path / "exact"
    rnnify.convert(str(BUNDLED), to="exact").save(out)
    check_hostable(out, head_size=32, num_kv_heads=2)  # the bundled model's own: hostable
    with pytest.raises(RnnifyError, match=r"vLLM cannot host target 'exact'.*head size \(16\)") as caught:
        check_hostable(out, head_size=16)
    assert "\n" not in str(caught.value)
    with pytest.raises(RnnifyError, match=r"2 kv heads; vLLM's pages hold the model's 1"):
        check_hostable(out, num_kv_heads=1)


REFUSALS = textwrap.dedent("""
    import json, sys

    if __name__ == "__main__":
        from vllm import LLM

        said = {}
        for path in sys.argv[1:]:
            try:
                LLM(path, enforce_eager=True, distributed_executor_backend="uni")
                said[path] = "served"
            except Exception as exc:
                said[path] = f"{type(exc).__name__}: {exc}"
        print("RESULTS " + json.dumps(said))
""")


def test_the_files_vllm_reads_itself_are_checked(tmp_path):
    """vLLM loads the tokenizer (and reads config.json) itself; rnnify.load, which checks them, builds
    only the model. Each directory differs from the saved one in a file vLLM would read."""
    from support import reseal

    saved = tmp_path / "saved"
    rnnify.convert(str(BUNDLED), to="window", window=16).save(saved)

    def changed(name: str, change) -> Path:
        directory = Path(shutil.copytree(saved, tmp_path / name))
        change(directory)
        return directory

    def tokenizer_config(directory: Path, **changes) -> None:
        config = json.loads((directory / "tokenizer_config.json").read_text())
        (directory / "tokenizer_config.json").write_text(json.dumps({**config, **changes}))

    def huge_heads(directory: Path) -> None:  # a cell built from them makes lists of that many heads
        cells = json.loads((directory / "rnnify.json").read_text())["cells"]
        cells[0]["spec"].update(num_heads=10**9, num_kv_heads=10**9)
        reseal(directory, cells=cells)

    cases = {
        changed("edited", lambda d: tokenizer_config(d, model_max_length=7)): "tokenizer_config.json",
        changed("heads", huge_heads): "spec num_heads 1,000,000,000 is more than the weights hold",
        changed("templates", lambda d: (d / "additional_chat_templates").mkdir()): "rnnify writes no such folder",
        changed(
            "model-class", lambda d: (tokenizer_config(d, tokenizer_class="LlamaForCausalLM"), reseal(d))
        ): "'LlamaForCausalLM' is not a tokenizer class",
    }
    said, _ = run_script(tmp_path / "refusals.py", REFUSALS, list(map(str, cases)), timeout=600)
    for directory, words in cases.items():
        assert words in said[str(directory)], said[str(directory)]


# -- the OpenAI-compatible server, through the official openai client ------------------------------


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory) -> Path:
    """The bundled model with a chat template (written into the source before converting, so the
    converted directory's integrity record covers it), converted to ``window`` 16."""
    root = tmp_path_factory.mktemp("vllm-chat")
    source = root / "source"
    shutil.copytree(BUNDLED, source)
    (source / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    out = root / "window"
    rnnify.convert(str(source), to="window", window=16).save(out)
    assert (out / "chat_template.jinja").read_text() == CHAT_TEMPLATE
    return out


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def server(chat_dir, tmp_path_factory):
    """vLLM's OpenAI server on ``chat_dir`` at a free port, ready (``/health``); stopped, with its
    engine process, at the end of the module. Yields (openai client, served model name)."""
    openai = pytest.importorskip("openai")
    port = free_port()
    log = tmp_path_factory.mktemp("vllm-server") / "server.log"
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(chat_dir)]
    command += ["--enforce-eager", "--host", "127.0.0.1", "--port", str(port)]
    with log.open("wb") as sink:
        # a session of its own: the server and the engine process it spawns stop together
        proc = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, env=vllm_env(), start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, f"vLLM's server exited (rc {proc.returncode}):\n{log.read_text()[-6000:]}"
            assert time.monotonic() < deadline, f"vLLM's server not ready in 300 s:\n{log.read_text()[-6000:]}"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            time.sleep(1)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)
        yield client, str(chat_dir)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


@pytest.fixture(scope="module")
def chat_model(chat_dir):
    return rnnify.load(chat_dir)


def complete(server, prompt: str, **options):
    client, name = server
    return client.completions.create(model=name, prompt=prompt, temperature=0, **options).choices[0]


def test_server_completions_equal_rnnify_generate(server, chat_model):
    for prompt in PROMPTS:
        choice = complete(server, prompt, max_tokens=NEW_TOKENS)
        assert choice.text == chat_model.generate(prompt, max_new_tokens=NEW_TOKENS), prompt


def test_server_chat_equals_rnnify_chat(server, chat_model):
    client, name = server
    conversations = [
        [{"role": "user", "content": "def main("}],
        [
            {"role": "system", "content": "You write Python."},
            {"role": "user", "content": "import os"},
            {"role": "assistant", "content": "import sys"},
            {"role": "user", "content": "class Config:"},
        ],
    ]
    for messages in conversations:
        response = client.chat.completions.create(model=name, messages=messages, max_tokens=NEW_TOKENS, temperature=0)
        assert response.choices[0].message.content == chat_model.chat(messages, max_new_tokens=NEW_TOKENS), messages


def test_server_streaming_equals_whole_text(server):
    client, name = server
    prompt = PROMPTS[2]
    whole = complete(server, prompt, max_tokens=NEW_TOKENS).text
    pieces = client.completions.create(model=name, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0, stream=True)
    assert "".join(chunk.choices[0].text for chunk in pieces if chunk.choices) == whole
    messages = [{"role": "user", "content": "def main("}]
    reply = client.chat.completions.create(model=name, messages=messages, max_tokens=NEW_TOKENS, temperature=0)
    deltas = client.chat.completions.create(
        model=name, messages=messages, max_tokens=NEW_TOKENS, temperature=0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in deltas if c.choices) == reply.choices[0].message.content


def test_server_stop_string_and_max_tokens(server, chat_model):
    prompt = PROMPTS[1]
    whole = complete(server, prompt, max_tokens=32).text
    assert len(whole) > 8, whole
    stop = whole[len(whole) // 2 : len(whole) // 2 + 2]
    stopped = complete(server, prompt, max_tokens=32, stop=[stop])
    assert stopped.text == whole[: whole.index(stop)] and stopped.finish_reason == "stop", (whole, stop, stopped.text)
    client, name = server
    short = client.completions.create(model=name, prompt=prompt, max_tokens=5, temperature=0)
    assert short.usage.completion_tokens == 5 and short.choices[0].finish_reason == "length", short
    assert short.choices[0].text == chat_model.generate(prompt, max_new_tokens=5)
    assert whole.startswith(short.choices[0].text)


def test_server_concurrent_requests_equal_sequential(server):
    prompts = PROMPTS + ["for i in range(10):\n    print(i)\n"]
    sequential = [complete(server, p, max_tokens=NEW_TOKENS).text for p in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        concurrent = list(pool.map(lambda p: complete(server, p, max_tokens=NEW_TOKENS).text, prompts))
    assert concurrent == sequential
