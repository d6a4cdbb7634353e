"""Serve tiny random models of many architectures through vLLM: greedy tokens against ``rnnify generate``.

    python benchmarks/vllm_sweep.py convert DIR [--only gpt2,falcon]     # rnnify's environment
    VLLM_CPU_KVCACHE_SPACE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 venv-vllm/bin/python benchmarks/vllm_sweep.py serve DIR \
        [--json benchmarks/results/vllm_sweep.json]
    python benchmarks/vllm_sweep.py --markdown FILE [--json ...]         # the table of a run
    VLLM_...=... venv-vllm/bin/python benchmarks/vllm_sweep.py text DIR CORPUS [--json FILE]  # a real model

``convert`` builds each of ARCHS as the architecture sweep does (``arch_configs.build``: 2 layers, 64
wide, random weights, seed 0) and saves it converted to each of TARGETS under DIR. ``serve`` runs in
vLLM's own environment (docs/serving.md): each directory through ``vllm.LLM`` (token-id prompts, so no
tokenizer is needed; three prompts of 1, 4 and 20 tokens batched, 10 greedy tokens each) and through
``rnnify.load(...).generate`` on the same ids. Status per directory: ``equal`` (every token the same),
``differs`` (the first differing prompt and both token lists), ``refused`` (vLLM or the plugin refused
it, in one line) or ``error``. The architectures are those whose configs name their sizes in their own
ways (GPT-2's ``n_embd``), whose attention adds terms (ALiBi, softcapping, sinks) or slides, mixes of
experts, multi-head latent attention, and models with recurrent layers of their own.

``text`` serves one converted directory of a real model with its tokenizer (the README's SmolLM2
recipe): two short prompts and the start of a document, batched, 24 greedy tokens each, against
``generate`` on the prompt ids vLLM's tokenizer made, and vLLM's log-prob of each token against
rnnify's log-softmax.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SWEEP_JSON = ROOT / "benchmarks" / "results" / "vllm_sweep.json"
ARCHS = (
    "gpt2,gptj,codegen,gpt_neo,gpt_neox,gpt_bigcode,falcon,mpt,opt,bloom,phi,phi3,qwen2,gemma,gemma2,gemma3_text,"
    "olmo2,stablelm,starcoder2,cohere,granite,mixtral,persimmon,biogpt,xglm,bart,deepseek_v3,gpt_oss,jamba,"
    "falcon_h1,qwen3_next,llama4_text"
).split(",")
TARGETS = {"exact": {}, "window": {"window": 8}}
PROMPTS = [[7], [5, 9, 17, 3], list(range(11, 31))]
NEW_TOKENS = 10


def convert(directory: Path, archs: list[str]) -> None:
    """Each architecture converted to each target under ``directory`` (``ARCH-TARGET``)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import arch_configs

    import rnnify

    for arch in archs:
        model, _ = arch_configs.build(arch)
        for target, options in TARGETS.items():
            try:
                rnnify.convert(model, to=target, **options).save(directory / f"{arch}-{target}")
            except rnnify.RnnifyError as exc:
                print(f"{arch}-{target}: not converted: {exc}", flush=True)


def serve(directory: Path) -> list[dict]:
    """Each converted directory under ``directory`` through vLLM and rnnify (module docstring)."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    import rnnify

    rows = []
    sampling = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, detokenize=False)
    for path in sorted(p for p in directory.iterdir() if p.is_dir()):
        row = {"name": path.name}
        try:
            llm = LLM(
                str(path),
                enforce_eager=True,
                skip_tokenizer_init=True,
                max_model_len=64,
                distributed_executor_backend="uni",
            )
        except rnnify.RnnifyError as exc:
            rows.append({**row, "status": "refused", "why": str(exc)})
            continue
        except Exception as exc:  # noqa: BLE001 - recorded, the sweep goes on
            rows.append({**row, "status": "error", "why": f"{type(exc).__name__}: {exc}"[:300]})
            continue
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], sampling)
        model = rnnify.load(path)
        differing = [found for found in (_compare(model, out) for out in outs) if found["status"] != "equal"]
        row.update(differing[0] if differing else {"status": "equal"})
        rows.append(row)
        print(row, flush=True)
        llm.llm_engine.engine_core.shutdown()
        del llm, model
        gc.collect()
    return rows


def _compare(model, out) -> dict:
    """vLLM's greedy tokens of one request (``out``) against ``model.generate`` on its prompt ids; where
    vLLM reported log-probs, the largest difference from rnnify's log-softmax of the same tokens."""
    import torch

    prompt, got = list(out.prompt_token_ids), list(out.outputs[0].token_ids)
    want = model.generate(torch.tensor([prompt]), max_new_tokens=len(got))[0, len(prompt) :].tolist()
    row = {"prompt_tokens": len(prompt), "status": "equal" if got == want else "differs"}
    if got != want:
        return {**row, "why": f"prompt of {len(prompt)} tokens: vLLM {got}, rnnify {want}"}
    if out.outputs[0].logprobs is not None:
        theirs = [step[token].logprob for step, token in zip(out.outputs[0].logprobs, got)]
        with torch.inference_mode():
            logits, state = model.prefill(torch.tensor([prompt]))
            ours = []
            for token in got:
                ours.append(float(torch.log_softmax(logits[0, -1].float(), -1)[token]))
                logits, state = model.step(torch.tensor([[token]]), state)
        row["max_logprob_difference"] = max(abs(a - b) for a, b in zip(theirs, ours))
    return row


def text(path: Path, corpus: Path, characters: int) -> list[dict]:
    """A converted directory with its tokenizer (a real model) through vLLM and rnnify: two short
    prompts and the first ``characters`` of ``corpus``, batched, 24 greedy tokens each."""
    from vllm import LLM, SamplingParams

    import rnnify

    prompts = ["The capital of France is", "def read_lines(path):", corpus.read_text()[:characters]]
    llm = LLM(str(path), enforce_eager=True, max_model_len=2048, distributed_executor_backend="uni")
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1))
    model = rnnify.load(path)
    return [{"name": path.name, **_compare(model, out)} for out in outs]


def markdown(rows: list[dict]) -> str:
    """A table of a run: a line per architecture, a column per target."""
    by_name = {row["name"]: row for row in rows}
    lines = ["| architecture | " + " | ".join(f"`{t}`" for t in TARGETS) + " |", "|---" * (len(TARGETS) + 1) + "|"]
    for arch in ARCHS:
        cells = []
        for target in TARGETS:
            row = by_name.get(f"{arch}-{target}", {"status": "not run"})
            cells.append(row["status"] + (f": {row['why']}" if row.get("why") and row["status"] != "equal" else ""))
        lines.append(f"| `{arch}` | " + " | ".join(cells) + " |")
    counts = {}
    for row in rows:
        counts[row["status"]] = counts.get(row["status"], 0) + 1
    summary = ", ".join(f"{status}: {n}" for status, n in sorted(counts.items()))
    return "\n".join([summary, "", *lines]) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", nargs="?", choices=("convert", "serve", "text"))
    parser.add_argument("directory", nargs="?", type=Path)
    parser.add_argument("corpus", nargs="?", type=Path, help="text: a file whose start is the long prompt")
    parser.add_argument("--characters", type=int, default=7000, help="text: the long prompt's length")
    parser.add_argument("--only", help="comma-separated architectures (default: ARCHS)")
    parser.add_argument("--json", type=Path, help="the run's record (default for serve and --markdown: SWEEP_JSON)")
    parser.add_argument("--markdown", type=Path, help="write the table of --json's run to this file")
    args = parser.parse_args()
    if args.markdown:
        args.markdown.write_text(markdown(json.loads((args.json or SWEEP_JSON).read_text())["rows"]))
    elif args.command == "convert":
        convert(args.directory, args.only.split(",") if args.only else list(ARCHS))
    elif args.command == "serve":
        import vllm

        rows = serve(args.directory)
        (args.json or SWEEP_JSON).write_text(json.dumps({"vllm": vllm.__version__, "rows": rows}, indent=1) + "\n")
    elif args.command == "text":
        import vllm

        rows = text(args.directory, args.corpus, args.characters)
        print(json.dumps(rows, indent=1))
        if args.json:
            args.json.write_text(json.dumps({"vllm": vllm.__version__, "rows": rows}, indent=1) + "\n")
    else:
        parser.error("give convert DIR, serve DIR, text DIR CORPUS or --markdown FILE")


if __name__ == "__main__":
    main()
