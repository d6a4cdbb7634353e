"""Recall on needle-in-prose rows (``examples/needle_corpus.py``): does each model answer the number?

    python benchmarks/needle_recall.py needles.jsonl --models out/hybrid out/hybrid-needles \
        --original models/smollm2 --rows 24 --threads 1

Each row is cut before its answer; every model decodes greedily from there, and a row counts when
the first number it writes is the row's (``rnnify.passkey.score``). Rows measure recall in the
wording and the haystack a model was trained on; ``rnnify eval --passkey`` is the held-out probe.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import torch

ANSWER = re.compile(r" (\d{5})\.$")
NEW_TOKENS = 8  # the 5 digits and a few tokens of margin


def main() -> None:
    from transformers import AutoModelForCausalLM

    import rnnify
    from rnnify.data import load_tokenizer
    from rnnify.passkey import converted_generator, original_generator, score
    from rnnify.runtime.threads import set_threads

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("data", type=Path, help=".jsonl written by examples/needle_corpus.py")
    parser.add_argument("--models", nargs="*", default=[], help="converted model directories")
    parser.add_argument("--original", help="Hugging Face directory of the original, measured beside them")
    parser.add_argument("--tokenizer", help="tokenizer directory (default: the original's, else the first model's)")
    parser.add_argument("--rows", type=int, default=24, help="rows to try, from the start of the file")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    if not args.models and not args.original:
        parser.error("nothing to measure: pass --models DIR ... and/or --original DIR")
    set_threads(args.threads)
    tokenizer = load_tokenizer(args.tokenizer or args.original or args.models[0])
    generators = {path: converted_generator(rnnify.load(path)) for path in args.models}
    if args.original:
        generators["original"] = original_generator(AutoModelForCausalLM.from_pretrained(args.original).eval())
    rows = [json.loads(line)["text"] for line in args.data.read_text().splitlines()[: args.rows]]
    hits = dict.fromkeys(generators, 0)
    with torch.no_grad():
        for text in rows:
            found = ANSWER.search(text)
            if found is None:
                raise SystemExit(
                    f"{args.data}: a row does not end with its 5-digit answer; "
                    "write the rows with examples/needle_corpus.py"
                )
            ids = tokenizer(text[: found.start()], add_special_tokens=False)["input_ids"]
            for name, generate in generators.items():
                hits[name] += score(tokenizer.decode(generate(ids, NEW_TOKENS)), found.group(1))
    for name, hit in hits.items():
        print(f"{name}: {hit}/{len(rows)} = {hit / len(rows):.0%}")


if __name__ == "__main__":
    main()
