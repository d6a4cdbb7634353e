"""Needle-in-prose rows for distillation: real text with a number stated once and asked for at the end.

    python examples/needle_corpus.py data/pydocs/train needles.jsonl --tokenizer models/smollm2 \
        --rows 300 --seq-len 256 --min-gap 90

Prose alone rarely asks a model to recall one fact from far back, so distilling on it does not
teach a constant-state memory to retrieve. Each row written here is ``--seq-len`` tokens of text
from the folder's files (shuffled with ``--seed``) with a random 5-digit number stated once, at a
random depth at least ``--min-gap`` tokens before the end, and a question that the row ends by
answering. The wordings differ from ``rnnify eval --passkey``'s ("The pass key is ..."), so that
probe stays held out. A row re-tokenises to exactly ``--seq-len`` tokens with the EOS (and BOS,
for a tokenizer that adds one) that ``rnnify distill`` packs around each document, so every
training row holds one whole exercise; rows whose seams tokenise differently are skipped.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from transformers import AutoTokenizer

from rnnify.data import adds_bos

# (statement, question that the number completes)
TEMPLATES = (
    ("The secret number is {key}. Keep it in mind.", "What is the secret number? The secret number is"),
    ("My locker code is {key}. Do not forget it.", "What is my locker code? My locker code is"),
    ("Note: the access code is {key}.", "What is the access code? The access code is"),
    ("The magic number for today is {key}.", "What is the magic number for today? The magic number is"),
    ("Remember that the order number is {key}.", "What was the order number? The order number is"),
    ("The password is {key}. Memorize it.", "What is the password? The password is"),
)
MAX_PAD = 12  # extra haystack tokens tried when re-tokenising the seams merges tokens


def needle_rows(tokenizer, files: list[Path], rows: int, seq_len: int, min_gap: int, seed: int) -> list[str]:
    """``rows`` texts of ``seq_len`` tokens with the packing's special tokens (see the module docstring)."""
    rng = random.Random(seed)
    files = sorted(files)
    rng.shuffle(files)
    budget = seq_len - 1 - adds_bos(tokenizer)  # document tokens per row: the packing adds EOS, and BOS where due

    def encode(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    haystack: list[int] = []
    out: list[str] = []
    for path in files:
        haystack.extend(encode(path.read_text(errors="ignore")))
        while len(out) < rows and len(haystack) >= budget + MAX_PAD:
            statement, question = rng.choice(TEMPLATES)
            key = str(rng.randrange(10_000, 100_000))
            said, asked = tokenizer.decode(encode(f" {statement.format(key=key)} ")), f" {question} {key}."
            room = budget - len(encode(said)) - len(encode(asked))
            if room < min_gap:
                raise SystemExit(f"--seq-len {seq_len} leaves no room for a {min_gap}-token gap: raise it")
            depth = rng.randrange(0, room - min_gap + 1)
            for pad in range(MAX_PAD):
                text = (
                    tokenizer.decode(haystack[:depth]) + said + tokenizer.decode(haystack[depth : room + pad]) + asked
                )
                size = len(encode(text))
                if size >= budget:
                    break
            del haystack[: room + pad]
            if size == budget:
                out.append(text)
        if len(out) == rows:
            return out
    raise SystemExit(f"the files hold text for {len(out)} rows of {seq_len} tokens, not {rows}: ask for fewer")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", type=Path, help="folder of text files (the haystack)")
    parser.add_argument("output", type=Path, help=".jsonl file to write, one row per line")
    parser.add_argument("--tokenizer", required=True, help="directory of the model's tokenizer")
    parser.add_argument("--rows", type=int, default=300)
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per row; pass the same to rnnify distill")
    parser.add_argument(
        "--min-gap",
        type=int,
        default=90,
        help="tokens at least between the number and the row's end (beyond a 64-token window)",
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if not args.source.is_dir():
        parser.error(f"{args.source} is not a folder: pass a folder of text files")
    files = [p for p in args.source.rglob("*") if p.is_file() and not p.name.startswith(".")]
    rows = needle_rows(
        AutoTokenizer.from_pretrained(args.tokenizer), files, args.rows, args.seq_len, args.min_gap, args.seed
    )
    partial = args.output.with_name(f".{args.output.name}.tmp")
    partial.write_text("".join(json.dumps({"text": row}) + "\n" for row in rows))
    partial.replace(args.output)
    print(f"wrote {len(rows)} rows of {args.seq_len} tokens to {args.output}")


if __name__ == "__main__":
    main()
