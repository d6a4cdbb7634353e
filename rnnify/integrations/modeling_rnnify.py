"""Loader of an rnnify model directory for transformers' ``trust_remote_code=True``.

rnnify writes this file, unchanged, into every directory it saves. It runs no code of its own:
it checks that rnnify is installed and recent enough, then hands transformers rnnify's classes,
which load the directory with ``rnnify.load`` (safetensors weights and a JSON graph, no pickle).
"""

import rnnify  # transformers checks this import first: "requires ... rnnify. Run `pip install rnnify`"

REQUIRED = (0, 1, 0)  # the first rnnify with rnnify.integrations.transformers


def _release(version):
    parts = []
    for part in version.split(".")[:3]:
        digits = "".join(c for c in part if c.isdigit()) if part[:1].isdigit() else ""
        parts.append(int(digits or 0))
    return tuple(parts + [0] * (3 - len(parts)))


if _release(rnnify.__version__) < REQUIRED:
    raise ImportError(
        f"this rnnify model directory needs rnnify >= {'.'.join(map(str, REQUIRED))}, "
        f"found {rnnify.__version__}: pip install -U rnnify"
    )

from rnnify.integrations.transformers import RnnifyConfig, RnnifyForCausalLM  # noqa: E402

__all__ = ["RnnifyConfig", "RnnifyForCausalLM"]
