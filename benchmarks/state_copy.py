"""What a decode step in rnnify's vLLM plugin pays to move states in and out of vLLM's slots.

    python benchmarks/state_copy.py models/smol-auto --batches 1,8,32 --threads 1

The plugin (rnnify/integrations/vllm/model.py) gathers the states of the sequences a step decodes
from vLLM's state cache (one slot per sequence), runs one batched ``step``, and writes the new
states back. This times those two copies against the step itself, in one process, rounds taken in
turn (median of ``--rounds``): the copies move every byte of every decoded sequence's state twice,
where the step reads it once and writes only what changed.
"""

from __future__ import annotations

import statistics
import time

import torch
from decode_parser import decode_parser
from rich.console import Console
from rich.table import Table

import rnnify
from rnnify.runtime.threads import set_threads


def main(argv: list[str] | None = None) -> int:
    parser = decode_parser(__doc__, prompt=64, rounds=5)
    parser.add_argument("--slots", type=int, default=134, help="slots of the state cache the sequences sit in")
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    if args.rounds < 1 or not 1 <= min(batches) <= max(batches) <= args.slots:
        parser.error("--rounds must be at least 1, and every batch between 1 and --slots")
    set_threads(args.threads)
    model = rnnify.load(args.model)
    template = model.init_state(1)
    pages = [torch.zeros((args.slots, *t.shape[1:]), dtype=t.dtype) for t in template.tensors]
    generator = torch.Generator().manual_seed(0)
    table = Table(title=f"{args.model}: decode step and state copies, ms ({args.threads} thread(s))")
    for column in ("sequences", "state per sequence, MiB", "step", "gather + scatter", "copies / step"):
        table.add_column(column, justify="right")
    for batch in batches:
        slots = torch.randperm(args.slots, generator=generator)[:batch]
        ids = torch.randint(0, model.manifest.vocab_size, (batch, 1), generator=generator)
        with torch.inference_mode():
            _, state = model.prefill(torch.randint(0, model.manifest.vocab_size, (batch, args.prompt)))
            model.step(ids, state)  # warm-up
            steps, copies = [], []
            for _ in range(args.rounds):
                started = time.perf_counter()
                _, new = model.step(ids, state)
                steps.append(time.perf_counter() - started)
                started = time.perf_counter()
                gathered = [page.index_select(0, slots) for page in pages]
                for page, tensor in zip(pages, new.tensors):
                    page.index_copy_(0, slots, tensor)
                copies.append(time.perf_counter() - started)
        del gathered
        step, copy = statistics.median(steps), statistics.median(copies)
        per_sequence = sum(t.nbytes for t in template.tensors) / 2**20
        table.add_row(str(batch), f"{per_sequence:.1f}", f"{step * 1e3:.0f}", f"{copy * 1e3:.0f}", f"{copy / step:.2f}")
    Console().print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
