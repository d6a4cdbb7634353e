"""A converted directory in stock lm-evaluation-harness (its ``hf`` model, ``trust_remote_code=True``), on
local YAML tasks, against lm-eval's ``hf`` model on the original and against rnnify's own computation.

Skipped without lm-eval (``pip install -e ".[lm-eval]"``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

import rnnify  # noqa: E402

TASKS = ("tiny_mc", "tiny_rolling", "tiny_gen")


def write_tasks(directory) -> None:
    """Three tasks, one per request type, over a JSON file: no hub, no download."""
    docs = [
        {
            "question": f"def f{i}(x):",
            "choices": ["    return x", "    pass", "import os"],
            "answer": i % 3,
            "text": f"def g{i}(a, b):\n    return a + b * {i}\n",
            "target": "    return",
        }
        for i in range(4)
    ]
    (directory / "docs.json").write_text(json.dumps(docs))
    common = (
        f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {directory / 'docs.json'}\ntest_split: test\n"
    )
    (directory / "mc.yaml").write_text(
        "task: tiny_mc\n" + common + "output_type: multiple_choice\ndoc_to_text: '{{question}}'\n"
        "doc_to_choice: '{{choices}}'\ndoc_to_target: answer\nmetric_list:\n  - metric: acc\n"
    )
    (directory / "rolling.yaml").write_text(
        "task: tiny_rolling\n" + common + "output_type: loglikelihood_rolling\ndoc_to_text: ''\n"
        "doc_to_target: '{{text}}'\nmetric_list:\n  - metric: word_perplexity\n"
    )
    (directory / "gen.yaml").write_text(
        "task: tiny_gen\n" + common + "output_type: generate_until\ndoc_to_text: '{{question}}'\n"
        "doc_to_target: '{{target}}'\ngeneration_kwargs:\n  until: ['\\n\\n']\n  max_gen_toks: 8\n"
        "  do_sample: false\nmetric_list:\n  - metric: exact_match\n"
    )


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    directory = tmp_path_factory.mktemp("lm-eval-tasks")
    write_tasks(directory)
    return directory


def test_exact_scores_and_generates_as_the_original_in_stock_lm_eval(tasks, converted_dir, tiny_model_dir, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    results = lm_eval.simple_evaluate(
        model="hf",
        model_args=f"pretrained={converted_dir('llama', 'exact')},trust_remote_code=True,batch_size=3",
        device="cpu",
        tasks=list(TASKS),
        task_manager=TaskManager(include_path=str(tasks)),
        log_samples=True,
    )
    reference = HFLM(pretrained=str(tiny_model_dir("llama")), device="cpu", dtype="float32", batch_size=3)
    for task, request_type in zip(TASKS, ("loglikelihood", "loglikelihood_rolling", "generate_until")):
        samples = results["samples"][task]
        requests = [
            Instance(request_type=request_type, doc={}, arguments=tuple(arguments), idx=0)
            for sample in samples
            for arguments in (
                sample["arguments"].values() if isinstance(sample["arguments"], dict) else sample["arguments"]
            )
        ]
        got = [response[0] for sample in samples for response in sample["resps"]]
        want = getattr(reference, request_type)(requests, disable_tqdm=True)
        assert len(got) == len(want) > 0
        if request_type == "loglikelihood":
            assert all(abs(g[0] - w[0]) < 1e-4 and g[1] == w[1] for g, w in zip(got, want))
        elif request_type == "loglikelihood_rolling":
            assert all(abs(g - w) < 1e-4 for g, w in zip(got, want))
        else:
            assert got == want


def test_stock_hflm_loglikelihood_equals_rnnify_s_own(converted_dir):
    """``HFLM(pretrained=DIR, trust_remote_code=True)`` as lm-eval builds it (``device_map={"": "cpu"}``): its
    log-likelihoods and greedy flags are those of ``rnnify.load(DIR).prefill``, summed in float64 here."""
    directory = converted_dir("llama", "exact")
    lm = HFLM(pretrained=str(directory), trust_remote_code=True, device="cpu", batch_size=1)
    assert type(lm.model).__name__ == "RnnifyForCausalLM"
    pairs = [("def read(path):", "\n    return open(path).read()"), ("import os\n", "import sys")]
    requests = [Instance(request_type="loglikelihood", doc={}, arguments=pair, idx=i) for i, pair in enumerate(pairs)]
    got = lm.loglikelihood(requests, disable_tqdm=True)
    model = rnnify.load(directory)
    for (logprob, greedy), (context, continuation) in zip(got, pairs):
        context_ids, continuation_ids = lm._encode_pair(context, continuation)
        logits, _ = model.prefill(torch.tensor([(context_ids + continuation_ids)[:-1]]))
        scores = torch.log_softmax(logits[0, -len(continuation_ids) :].double(), dim=-1)
        target = torch.tensor(continuation_ids)
        assert abs(logprob - float(scores.gather(-1, target[:, None]).sum())) < 1e-4
        assert greedy == bool((scores.argmax(-1) == target).all())


def test_stock_hflm_reads_a_gpt2_conversions_learned_positions(converted_dir, tiny_model_dir):
    """GPT-2 names its table length ``n_positions``; lm-eval looks for ``max_position_embeddings`` (and
    ``n_positions``) on the config it loads, else takes 2,048, past which the conversion stops: its
    rolling windows must fit the table."""
    source = json.loads((tiny_model_dir("gpt2") / "config.json").read_text())
    lm = HFLM(pretrained=str(converted_dir("gpt2", "exact")), trust_remote_code=True, device="cpu", batch_size=1)
    assert lm.max_length == source["n_positions"] != 2048


@pytest.mark.slow
def test_stock_lm_eval_command_runs_a_local_task(tasks, converted_dir, tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    command = [
        sys.executable,
        "-m",
        "lm_eval",
        "run",
        "--model",
        "hf",
        "--model_args",
        f"pretrained={converted_dir('llama', 'exact')},trust_remote_code=True",
        "--device",
        "cpu",
        "--tasks",
        "tiny_rolling",
        "--include_path",
        str(tasks),
        "--output_path",
        str(tmp_path / "out"),
    ]
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "tiny_rolling" in done.stdout and "word_perplexity" in done.stdout
