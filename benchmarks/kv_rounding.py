"""What rounding every key and value costs a model, before any window: is a storage dtype worth it?

    python benchmarks/kv_rounding.py models/smollm2 --data data/pydocs/heldout --seq-len 2048 --rows 2 \
        --threads 2 --json benchmarks/results/kv-rounding-smollm2-2048.json

The original model (transformers, float32, full attention) reads ``--rows`` held-out rows (the first
rows ``rnnify eval`` reads, ``rnnify.data.token_batches``), first as it is, then with its keys and
values rounded as they leave ``k_proj`` and ``v_proj`` (before rotary embeddings, which turn pairs
of entries and keep their size) in each storage considered: float16,
bfloat16, float8 (e4m3 and e5m2, unscaled and, for e4m3, scaled per vector), and int8 and int4 per
vector at the scale that puts the largest entry at the top level. Each row of the table: perplexity
ratio and KL(original || rounded) per token. ``rnnify.kernels.slots`` builds one of them (int8, its
scale a power of two).
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rnnify.data import token_batches
from rnnify.runtime.threads import set_threads


def _per_vector(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    return x.unflatten(-1, (-1, head_dim))


def integer(bits: int, head_dim: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """Symmetric integers of ``bits`` per vector, the largest entry at the top level."""
    top = 2 ** (bits - 1) - 1

    def rounded(x: torch.Tensor) -> torch.Tensor:
        v = _per_vector(x, head_dim)
        scale = v.abs().amax(-1, keepdim=True).clamp_min(1e-30) / top
        return ((v / scale).round().clamp(-top, top) * scale).flatten(-2)

    return rounded


def float8(dtype: torch.dtype, head_dim: int, scaled: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    """A cast to ``dtype``; ``scaled``: per vector, the largest entry at the dtype's largest value."""

    def rounded(x: torch.Tensor) -> torch.Tensor:
        v = _per_vector(x, head_dim)
        scale = v.abs().amax(-1, keepdim=True).clamp_min(1e-30) / torch.finfo(dtype).max if scaled else 1.0
        return ((v / scale).to(dtype).float() * scale).flatten(-2)

    return rounded


def storages(head_dim: int) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    return {
        "float16": lambda x: x.half().float(),
        "bfloat16": lambda x: x.bfloat16().float(),
        "float8 e4m3": float8(torch.float8_e4m3fn, head_dim, scaled=False),
        "float8 e4m3, scaled per vector": float8(torch.float8_e4m3fn, head_dim, scaled=True),
        "float8 e5m2": float8(torch.float8_e5m2, head_dim, scaled=False),
        "int8 per vector": integer(8, head_dim),
        "int4 per vector": integer(4, head_dim),
    }


@torch.no_grad()
def log_probs(model, rows: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(model(rows).logits[:, :-1].float(), -1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a Hugging Face model directory")
    parser.add_argument("--data", required=True, help="held-out text: a file or folder")
    parser.add_argument("--seq-len", type=int, default=2048, help="tokens per row")
    parser.add_argument("--rows", type=int, default=2, help="rows read")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--json", help="write the table to this file")
    args = parser.parse_args(argv)
    set_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    # the rows `rnnify eval --seq-len L --batch-size R --max-tokens R x L` reads first
    batch = next(token_batches(args.data, tokenizer, seq_len=args.seq_len, batch_size=args.rows))
    if not batch["attention_mask"].all():
        parser.error(f"--data holds fewer than --rows x --seq-len ({args.rows * args.seq_len}) tokens")
    rows = batch["input_ids"]
    targets = rows[:, 1:, None]
    original = log_probs(model, rows)
    original_nll = -original.gather(-1, targets).mean().item()
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    projections = [m for name, m in model.named_modules() if name.endswith(("k_proj", "v_proj"))]
    results = []
    for name, rounded in storages(head_dim).items():
        hooks = [p.register_forward_hook(lambda module, inputs, out, f=rounded: f(out)) for p in projections]
        try:
            got = log_probs(model, rows)
        finally:
            for hook in hooks:
                hook.remove()
        nll = -got.gather(-1, targets).mean().item()
        kl = (original.exp() * (original - got)).sum(-1).mean().item()
        results.append({"storage": name, "perplexity_ratio": math.exp(nll - original_nll), "kl": kl})
        print(f"{name:32s} perplexity ratio {results[-1]['perplexity_ratio']:.4f}  KL {kl:.5f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"model": args.model, "seq_len": args.seq_len, "rows": args.rows, "results": results}, f, indent=1
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
