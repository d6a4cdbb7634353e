"""Train the small Llama model that ships with rnnify, on the standard library's source, on a CPU.

    python examples/train_tiny_lm.py examples/models/stdlib-llama

No model hub is reachable where rnnify is developed, so the quickstart, examples and fidelity
numbers need a real pretrained model of their own. This one is a Llama (RoPE, grouped-query
attention: 8 query heads over 2 key/value heads) with about 3.7M parameters, trained from scratch
on ``stdlib_corpus.py``'s training files with a byte-level BPE tokenizer trained on the same files.
Everything is seeded; it reports held-out perplexity (files never seen in training). The committed
model took 57 minutes on a 2-core machine shared with other jobs; when the machine was otherwise
idle it trained at 1.45-1.6 steps/s, about 13 minutes for the 1,200 steps. The output directory is a normal Hugging Face model directory plus
``training.json`` (settings, held-out perplexity, tokens, wall time, command).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
import stdlib_corpus  # noqa: E402

EOS = "<|endoftext|>"


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS, bos_token=EOS)


def encode(tokenizer, texts: list[str]) -> torch.Tensor:
    """All documents as one stream of ids, each followed by EOS."""
    ids = []
    for row in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        ids.extend(row)
        ids.append(tokenizer.eos_token_id)
    return torch.tensor(ids, dtype=torch.long)


def model_config(vocab_size: int, eos_id: int, seq_len: int):
    """The model's shape; its ``max_position_embeddings`` is the row length it trains on, the positions
    it has seen, so that tools warn past them (its rotary embedding computes any position)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=640,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=seq_len,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
    )


def learning_rate(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def perplexity(model, ids: torch.Tensor, seq_len: int, batch_size: int, max_tokens: int) -> float:
    """Next-token perplexity over non-overlapping ``seq_len`` windows of ``ids``."""
    rows = ids[: min(len(ids), max_tokens) // seq_len * seq_len].view(-1, seq_len)
    if not len(rows):
        raise SystemExit(f"the held-out text has fewer than {seq_len} tokens: lower --seq-len")
    total, count = 0.0, 0
    for batch in rows.split(batch_size):
        logits = model(batch).logits[:, :-1]
        total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1), reduction="sum").item()
        count += batch[:, 1:].numel()
    return math.exp(total / count)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", help="where to write the model")
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=1200)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--eval-tokens", type=int, default=200_000)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    out = Path(args.directory)
    if out.exists():
        raise SystemExit(f"{out} already exists: remove it or choose another directory")

    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    start, cpu_start = time.time(), time.process_time()

    train_files, heldout_files = stdlib_corpus.split()
    train_texts = [stdlib_corpus.read(f) for f in train_files]
    tokenizer = train_tokenizer(train_texts, args.vocab_size)
    train_ids = encode(tokenizer, train_texts)
    heldout_ids = encode(tokenizer, [stdlib_corpus.read(f) for f in heldout_files])
    print(
        f"corpus: {len(train_files)} train files ({len(train_ids):,} tokens), "
        f"{len(heldout_files)} held-out files ({len(heldout_ids):,} tokens)"
    )

    model = AutoModelForCausalLM.from_config(
        model_config(len(tokenizer), tokenizer.eos_token_id, args.seq_len), attn_implementation="sdpa"
    )
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {params / 1e6:.2f}M parameters")
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
    )
    generator = torch.Generator().manual_seed(args.seed)
    model.train()
    bar = tqdm(range(args.steps), desc="train", unit="step")
    for step in bar:
        starts = torch.randint(0, len(train_ids) - args.seq_len - 1, (args.batch_size,), generator=generator)
        batch = torch.stack([train_ids[s : s + args.seq_len + 1] for s in starts.tolist()])
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, args.steps, args.lr, args.warmup)
        logits = model(batch[:, :-1]).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        bar.set_postfix(
            loss=f"{loss.item():.3f}", tok_s=f"{(step + 1) * batch.numel() / bar.format_dict['elapsed']:.0f}"
        )
    model.eval()

    heldout_ppl = perplexity(model, heldout_ids, args.seq_len, args.batch_size, args.eval_tokens)
    wall = time.time() - start
    print(
        f"held-out perplexity {heldout_ppl:.2f} ({min(len(heldout_ids), args.eval_tokens):,} tokens); {wall / 60:.1f} min"
    )

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}-"))  # renamed into place at the end
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    record = {
        "command": "python examples/train_tiny_lm.py " + " ".join(sys.argv[1:]),
        "settings": vars(args),
        "parameters": params,
        "train_files": len(train_files),
        "heldout_files": len(heldout_files),
        "train_tokens_seen": args.steps * args.batch_size * args.seq_len,
        "corpus_train_tokens": len(train_ids),
        "heldout_perplexity": round(heldout_ppl, 3),
        "heldout_eval_tokens": min(len(heldout_ids), args.eval_tokens) // args.seq_len * args.seq_len,
        "wall_seconds": round(wall),
        "cpu_seconds": round(time.process_time() - cpu_start),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
    }
    (tmp / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    os.replace(tmp, out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
