"""What the command-line tests share: running ``rnnify.cli.main`` in-process, the shape of a user
error, and quick edits of a converted directory."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

from rnnify.cli import main
from rnnify.runtime.manifest import MANIFEST_FILE
from rnnify.runtime.storage import WEIGHTS_FILE


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


# the lines a command's stages print where stderr is not a terminal (``rnnify.progress``)
STAGE_LINE = re.compile(r"[\w ]+ \.\.\.|[\w ]+: \d+\.\d s")


def assert_user_error(code: int, err: str, *words: str) -> None:
    """One ``error:`` line and exit 2; before it, at most the lines of the stages that had started."""
    assert code == 2, err
    assert "Traceback" not in err
    lines = [line for line in err.strip().splitlines() if not STAGE_LINE.fullmatch(line)]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for word in words:
        assert word in lines[0]


def copy_model(src: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(src, tmp_path / "copy"))


def alter_weight(directory: Path) -> None:
    tensors = load_file(directory / WEIGHTS_FILE)
    tensors["model.norm.weight"][0] += 1.0
    save_file(tensors, directory / WEIGHTS_FILE, metadata={"format": "pt"})


def edit_manifest(directory: Path, **changes) -> None:
    path = directory / MANIFEST_FILE
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def eos_id(directory: Path) -> int:
    return json.loads((directory / "generation_config.json").read_text())["eos_token_id"]
