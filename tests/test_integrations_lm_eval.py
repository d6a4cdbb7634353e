"""The ``rnnify`` lm-eval model on local YAML tasks, against lm-eval's own ``hf`` model on the original.

Skipped without lm-eval (``pip install -e ".[lm-eval]"``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

lm_eval = pytest.importorskip("lm_eval")

import rnnify.integrations.lm_eval  # noqa: E402,F401  (registers the "rnnify" model)
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

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
    common = f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {directory / 'docs.json'}\ntest_split: test\n"
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


def test_exact_scores_and_generates_as_the_original_through_lm_eval(tasks, converted_dir, tiny_model_dir, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    results = lm_eval.simple_evaluate(
        model="rnnify",
        model_args=f"path={converted_dir('llama', 'exact')},batch_size=3",
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
            for arguments in (sample["arguments"].values() if isinstance(sample["arguments"], dict) else sample["arguments"])
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


@pytest.mark.slow
def test_rnnify_lm_eval_command_runs_a_local_task(tasks, converted_dir, tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    command = [
        sys.executable, "-m", "rnnify.integrations.lm_eval", "run", "--model", "rnnify",
        "--model_args", f"path={converted_dir('llama', 'exact')}", "--tasks", "tiny_rolling",
        "--include_path", str(tasks), "--output_path", str(tmp_path / "out"),
    ]
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "tiny_rolling" in done.stdout and "word_perplexity" in done.stdout
