"""What does transformers' ``generate`` cost over rnnify's own? Per-token time of both, side by side.

    python benchmarks/hf_generate_overhead.py CONVERTED_DIR [--tokens 64] [--repeats 5] [--threads 1]

Greedy decoding of ``--tokens`` new tokens after a 16-token prompt, batch 1, both stopping at the
model's end-of-text token, by ``RecurrentModel.generate`` and by ``RnnifyForCausalLM.generate``
(transformers' loop over the recurrent cache), alternating, ``--repeats`` times each. Time is the
process's CPU time (with one thread, the work done; other jobs on a shared machine do not count);
per token is (time for N tokens - time for 1 token) / (N - 1), so the prompt's prefill cancels;
the minimum over the repeats is reported. Both must produce the same N tokens. README.md and
docs/interop.md quote its output.
"""

from __future__ import annotations

import argparse
import time

import torch
from rich.console import Console
from rich.table import Table

import rnnify
from rnnify.integrations.transformers import RnnifyForCausalLM


def seconds(generate, ids: torch.Tensor, tokens: int) -> tuple[float, torch.Tensor]:
    start = time.process_time()
    out = generate(ids, tokens)
    return time.process_time() - start, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", help="converted model directory")
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per run (default 64)")
    parser.add_argument("--repeats", type=int, default=5, help="runs of each, alternating (default 5)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = rnnify.load(args.dir)
    wrapper = RnnifyForCausalLM.from_rnnify(model)
    ids = torch.randint(1, model.manifest.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    eos = wrapper.generation_config.eos_token_id
    runs = {
        "rnnify generate": lambda x, n: model.generate(x, max_new_tokens=n, eos_token_id=eos),
        "transformers generate": lambda x, n: wrapper.generate(x, max_new_tokens=n, do_sample=False),
    }
    best = {name: float("inf") for name in runs}
    outputs = {}
    for name, run in runs.items():  # warm-up
        run(ids, args.tokens)
    for _ in range(args.repeats):
        for name, run in runs.items():
            one, _ = seconds(run, ids, 1)
            many, outputs[name] = seconds(run, ids, args.tokens)
            best[name] = min(best[name], (many - one) / (args.tokens - 1))
    first, second = outputs.values()
    if not torch.equal(first, second) or first.shape[1] != ids.shape[1] + args.tokens:
        raise SystemExit("the two loops produced different tokens, or stopped early; try another --tokens")
    base = best["rnnify generate"]
    table = Table(
        title=f"{model.target} model, {args.tokens} greedy tokens, batch 1, {args.threads} thread(s), min of {args.repeats}"
    )
    for column in ("loop", "ms / token", "vs rnnify"):
        table.add_column(column, justify="left" if column == "loop" else "right")
    for name, value in best.items():
        table.add_row(name, f"{value * 1e3:.3f}", f"{(value / base - 1) * 100:+.1f}%")
    Console().print(table)


if __name__ == "__main__":
    main()
