"""Convert to the hybrid target (a window plus a memory of older tokens), distil it, evaluate it, save it.

    python examples/stdlib_corpus.py data/stdlib      # text to distil on and to evaluate on
    python examples/distill_hybrid.py examples/models/stdlib-llama --data data/stdlib/train \
        --heldout data/stdlib/heldout --window 64 --tokens 200000 -o stdlib-hybrid

Each layer becomes LoLCATs' hybrid: softmax over the last --window tokens and --sinks, plus a --memory
of the tokens that left the window, gated off at first. Distillation trains it towards the original
model: attention transfer (each layer's output towards the softmax one), then finetuning on the next-token
KL, --tokens split between the two. KL and perplexity against the original are printed before and after.
"""

from __future__ import annotations

import argparse

import rnnify


def main(argv: list[str] | None = None) -> dict:
    """Convert, evaluate, distil, evaluate again and save; returns the KL before and after."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="a Hugging Face model directory (or GGUF file)")
    p.add_argument("--data", required=True, help="text to distil on: a file, folder or .jsonl")
    p.add_argument("--heldout", help="text to evaluate on (default: --data)")
    p.add_argument(
        "-o", "--output", default="hybrid-distilled", help="directory to save to (default: hybrid-distilled)"
    )
    p.add_argument("--window", type=int, default=64, help="recent tokens of softmax (default: 64)")
    p.add_argument("--sinks", type=int, default=4, help="first tokens kept (default: 4)")
    p.add_argument("--memory", default="linear", help="linear, gla, delta or gated-delta (default: linear)")
    p.add_argument("--tokens", type=int, default=200_000, help="tokens to distil on, both stages (default: 200000)")
    p.add_argument(
        "--seq-len", type=int, help="tokens per row (default: rnnify's, 1024 or the model's position limit if lower)"
    )
    p.add_argument("--batch-size", type=int, default=8, help="rows per step (default: 8)")
    p.add_argument("--eval-tokens", type=int, default=16384, help="held-out tokens to evaluate (default: 16384)")
    args = p.parse_args(argv)

    model = rnnify.convert(args.model, to="hybrid", window=args.window, sinks=args.sinks, memory=args.memory)
    heldout = args.heldout or args.data

    def measure(when: str) -> float:
        result = rnnify.evaluate(model, heldout, seq_len=args.seq_len, max_tokens=args.eval_tokens, layer_errors=False)
        print(
            f"{when}: KL {result.kl:.4f} nats/token, perplexity {result.perplexity:.3f} "
            f"(original {result.teacher_perplexity:.3f}), top-1 agreement {result.top1_agreement:.1%}"
        )
        return result.kl

    before = measure("converted")
    rnnify.distill(
        model,
        args.data,
        stages=("transfer", "finetune"),
        max_tokens=args.tokens,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        progress=False,
    )
    trained = {stage["stage"]: stage["tokens"] for stage in model.manifest.distill["trained"]}
    print("distilled: " + ", ".join(f"{stage} {tokens:,} tokens" for stage, tokens in trained.items()))
    after = measure("distilled")
    model.save(args.output)  # the manifest records the distillation's settings and tokens
    print(f"saved to {args.output}: state {model.state_nbytes(1 << 20):,} bytes per sequence at any context")
    return {"kl_before": before, "kl_after": after, "trained": trained}


if __name__ == "__main__":
    main()
