"""Build a tiny random-weight causal LM with a real tokenizer, entirely offline.

    python examples/make_tiny_model.py tiny-llama [--arch llama|gpt2|mistral|gpt2-small]

The tokenizer is a byte-level BPE trained in a second on a few files of the Python standard
library, so prompts are real text; the weights are random (the model is for trying the tools,
not for reading its output). The tests build their models with this script too. ``gpt2-small``
is GPT-2 small's shape (12 layers, 12 heads, 768 wide, 50,257-token vocabulary) with
``GPT2_SMALL_POSITIONS`` learned positions, enough to decode after a 16k context: the model
``docs/performance.md`` measures.
"""

from __future__ import annotations

import argparse
import sysconfig
from pathlib import Path

import torch

VOCAB_SIZE = 320
GPT2_SMALL_POSITIONS = 17408  # 16k context + 1k decoded tokens
_TOKENIZER_SOURCES = ("this.py", "textwrap.py", "keyword.py")


def train_tokenizer(vocab_size: int = VOCAB_SIZE):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [(stdlib / name).read_text(encoding="utf-8") for name in _TOKENIZER_SOURCES if (stdlib / name).is_file()]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>", bos_token="<|endoftext|>")


def tiny_config(arch: str, vocab_size: int = VOCAB_SIZE):
    from transformers import GPT2Config, LlamaConfig, MistralConfig

    common = {"vocab_size": vocab_size, "bos_token_id": 0, "eos_token_id": 0}
    if arch == "gpt2":
        return GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=128, **common)
    if arch == "gpt2-small":  # the tokenizer covers only the first VOCAB_SIZE ids of the 50,257
        common["vocab_size"] = 50257
        return GPT2Config(n_embd=768, n_layer=12, n_head=12, n_positions=GPT2_SMALL_POSITIONS, **common)
    if arch == "llama":
        return LlamaConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=128,
            **common,
        )
    if arch == "mistral":
        return MistralConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
            sliding_window=16,
            **common,
        )
    raise ValueError(f"unknown arch {arch!r}")


def make_tiny_model(directory: str | Path, arch: str = "llama", seed: int = 0) -> Path:
    """Write a tiny random ``arch`` model and its tokenizer to ``directory``."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch))
    directory = Path(directory)
    model.save_pretrained(directory)
    train_tokenizer().save_pretrained(directory)
    return directory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", help="where to write the model")
    parser.add_argument("--arch", default="llama", choices=["llama", "gpt2", "mistral", "gpt2-small"])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(f"wrote {make_tiny_model(args.directory, args.arch, args.seed)}")


if __name__ == "__main__":
    main()
