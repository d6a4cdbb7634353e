"""rnnify's vLLM plugin (rnnify.integrations.vllm): vLLM's greedy tokens equal rnnify's own, token by token.

Skipped unless vLLM imports (it is not a dependency: docs/serving.md says how to install it). vLLM
starts its engine in a spawned process, so each vLLM run is a script of its own, under the
``if __name__ == "__main__":`` guard, run in a subprocess that prints its results as JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("vllm")

import rnnify
from rnnify.errors import RnnifyError
from rnnify.integrations.vllm.hosting import check_hostable

ROOT = Path(__file__).resolve().parents[1]
BUNDLED = ROOT / "examples" / "models" / "stdlib-llama"
# a one-token prompt (decoded with the batched step from a fresh slot), a short one, and one longer
# than the window (16), so the window's ring buffer wraps during prefill
PROMPTS = [
    "The",
    "def main(",
    "import os\nimport sys\n\nclass Config:\n    def __init__(self, path):\n        self.path = path\n",
]

SCRIPT = textwrap.dedent("""
    import json, sys, time

    if __name__ == "__main__":
        path, prompts, engine, sampling, rounds = json.loads(sys.argv[1])
        import torch
        from vllm import LLM, SamplingParams
        import rnnify

        started = time.perf_counter()
        llm = LLM(path, enforce_eager=True, **engine)
        startup = time.perf_counter() - started
        model = rnnify.load(path)
        eos = model.tokenizer.eos_token_id
        results = []
        for round_ in range(rounds):
            batch = prompts if round_ % 2 == 0 else prompts[::-1]
            for out in llm.generate(batch, SamplingParams(temperature=0, **sampling)):
                ids = torch.tensor([out.prompt_token_ids])
                want = model.generate(ids, max_new_tokens=sampling["max_tokens"])[0, ids.shape[1]:].tolist()
                results.append(dict(prompt=out.prompt, got=list(out.outputs[0].token_ids), want=want))
        print("RESULTS " + json.dumps(dict(results=results, eos=eos, startup=startup)))
""")


def run_vllm(tmp_path: Path, path: Path, prompts: list[str], engine: dict, sampling: dict, rounds: int = 1) -> dict:
    script = tmp_path / "run_vllm.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
    env.pop("TRITON_INTERPRET", None)  # conftest's, for rnnify's kernel tests; vLLM would take it as a Triton backend
    proc = subprocess.run(
        [sys.executable, str(script), json.dumps([str(path), prompts, engine, sampling, rounds])],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
        check=False,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULTS ")]
    assert proc.returncode == 0 and lines, f"vLLM run failed (rc {proc.returncode}):\n{proc.stderr[-6000:]}"
    return json.loads(lines[-1][len("RESULTS ") :])


def assert_same_tokens(result: dict, max_tokens: int, ignore_eos: bool) -> None:
    """vLLM's tokens are rnnify's, token by token; vLLM stops early only on the end-of-sequence id."""
    eos = result["eos"]
    for row in result["results"]:
        got, want = row["got"], row["want"]
        for i, (a, b) in enumerate(zip(got, want)):
            assert a == b, f"prompt {row['prompt']!r}: token {i} is {a} in vLLM, {b} in rnnify ({got} vs {want})"
        if ignore_eos or not got or got[-1] != eos:
            assert len(got) == max_tokens, f"prompt {row['prompt']!r}: vLLM gave {len(got)} tokens: {got}"


@pytest.fixture(scope="module")
def window_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("vllm") / "window"
    rnnify.convert(str(BUNDLED), to="window", window=16).save(out)
    return out


def test_greedy_equals_rnnify_generate(window_dir, tmp_path):
    """Three prompts of different lengths submitted together: one prefill each, then batched steps."""
    result = run_vllm(tmp_path, window_dir, PROMPTS, {}, {"max_tokens": 16})
    assert len(result["results"]) == len(PROMPTS)
    assert_same_tokens(result, 16, ignore_eos=False)


def test_chunked_prefill_and_reused_slots(window_dir, tmp_path):
    """A 16-token budget splits the longer prompts into chunks that continue from the stored state;
    two sequences at a time make later prompts take slots that finished ones left; a second call
    (in reverse order) finds no state left from the first."""
    prompts = PROMPTS + [
        "for i in range(10):\n    print(i)\n",
        "x",
        "class A:\n    pass\n\n\nclass B(A):\n    def f(self):",
    ]
    engine = {"max_num_seqs": 2, "max_num_batched_tokens": 16, "max_model_len": 256}
    result = run_vllm(tmp_path, window_dir, prompts, engine, {"max_tokens": 24, "ignore_eos": True}, rounds=2)
    assert len(result["results"]) == 2 * len(prompts)
    assert_same_tokens(result, 24, ignore_eos=True)


def test_growing_state_is_refused(tmp_path):
    """``exact`` keeps a KV cache that grows: refused with one line naming the target."""
    out = tmp_path / "exact"
    rnnify.convert(str(BUNDLED), to="exact").save(out)
    with pytest.raises(RnnifyError, match=r"cannot host target 'exact'") as caught:
        check_hostable(out)
    assert "\n" not in str(caught.value)
