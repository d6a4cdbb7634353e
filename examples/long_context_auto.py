"""Choose per kv head with ``--to auto`` under a state budget, then measure it against the original.

    python examples/stdlib_corpus.py data/stdlib      # calibration and held-out text (the stdlib's source)
    python examples/long_context_auto.py examples/models/stdlib-llama --data data/stdlib/train \
        --heldout data/stdlib/heldout --state-budget 30% --at-context 256 --window 32 --retrieval-window 128 \
        -o stdlib-auto

The kv heads that lose most as a short window (scored on the calibration text and pass-key prompts)
keep a --retrieval-window-token window while they fit --state-budget at --at-context tokens; the rest
keep --window tokens and --sinks. Then: perplexity and KL against the original on rows of --seq-len
held-out tokens, and pass-key accuracy of both models at each --passkey length.
"""

from __future__ import annotations

import argparse

import rnnify
from rnnify.auto import auto_convert


def main(argv: list[str] | None = None) -> dict:
    """Choose, save and evaluate; returns the numbers printed."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="a Hugging Face model directory (or GGUF file)")
    p.add_argument("--data", required=True, help="calibration text: a file, folder or .jsonl")
    p.add_argument("--heldout", help="text to evaluate on (default: --data)")
    p.add_argument("-o", "--output", default="auto-model", help="directory to save to (default: auto-model)")
    p.add_argument("--state-budget", default="30%", help="bytes or a share of the KV cache (default: 30%%)")
    p.add_argument("--at-context", type=int, default=2048, help="context of the budget (default: 2048)")
    p.add_argument("--window", type=int, default=64, help="window of the other heads (default: 64)")
    p.add_argument("--sinks", type=int, default=4, help="first tokens every head keeps (default: 4)")
    p.add_argument("--retrieval-window", type=int, default=256, help="window of the chosen heads (default: 256)")
    p.add_argument(
        "--calib-len",
        type=int,
        help="tokens per calibration row (default: rnnify's, 1024 or the model's position limit if lower)",
    )
    p.add_argument("--calib-rows", type=int, default=2, help="calibration text rows (default: 2)")
    p.add_argument("--calib-passkey", type=int, default=2, help="calibration pass-key prompts (default: 2)")
    p.add_argument(
        "--seq-len",
        type=int,
        help="tokens per evaluation row (default: rnnify's, 1024 or the model's position limit if lower)",
    )
    p.add_argument("--eval-tokens", type=int, default=16384, help="held-out tokens to evaluate (default: 16384)")
    p.add_argument(
        "--passkey",
        type=int,
        nargs="+",
        help="pass-key prompt lengths (default: a half and three quarters of the evaluation row)",
    )
    p.add_argument("--passkey-trials", type=int, default=4, help="prompts per length (default: 4)")
    args = p.parse_args(argv)

    model, report = auto_convert(
        args.model,
        args.data,
        budget=args.state_budget,
        context=args.at_context,
        window=args.window,
        sinks=args.sinks,
        retrieval_window=args.retrieval_window,
        calib_len=args.calib_len,
        calib_rows=args.calib_rows,
        passkey=args.calib_passkey,
    )
    model.save(args.output)  # with head_map.json: the scores and the choice
    heads, share = len(report.scores[report.score]), report.state_bytes / report.kv_cache_bytes
    chosen = (
        f"all {heads} kv heads keep {args.retrieval_window} tokens"
        if len(report.retrieval) == heads
        else f"{len(report.retrieval)} of {heads} kv heads keep {args.retrieval_window} tokens, the rest {args.window}"
    )
    print(
        f"saved to {args.output}: {chosen}; state {report.state_bytes:,} bytes at {args.at_context:,} tokens "
        f"({share:.1%} of the KV cache)"
    )

    result = rnnify.evaluate(
        model, args.heldout or args.data, seq_len=args.seq_len, max_tokens=args.eval_tokens, layer_errors=False
    )
    ratio = result.perplexity / result.teacher_perplexity
    print(
        f"rows of {result.seq_len} tokens ({result.tokens:,} tokens): perplexity {result.perplexity:.3f} "
        f"(original {result.teacher_perplexity:.3f}, ratio {ratio:.3f}), KL {result.kl:.4f} nats/token"
    )

    lengths = args.passkey or [result.seq_len // 2, result.seq_len * 3 // 4]  # the answer's tokens fit after
    passkey = rnnify.evaluate_passkey(model, lengths, trials=args.passkey_trials).accuracy()
    for length in lengths:
        print(
            f"pass key at {length:,} tokens: {passkey['converted'][length]:.0%} "
            f"(original {passkey['original'][length]:.0%})"
        )
    return {
        "retrieval": report.retrieval,
        "state_bytes": report.state_bytes,
        "perplexity_ratio": ratio,
        "kl": result.kl,
        "passkey": passkey,
    }


if __name__ == "__main__":
    main()
