"""What a converted directory tells Hugging Face tools: its ``config.json`` and ``modeling_rnnify.py``.

A converted directory keeps the source model's tokenizer files, but its ``config.json`` must not
be the source's: ``AutoModelForCausalLM.from_pretrained`` would then build the original softmax
model from it and find none of its weights under the names it expects (and say so only in a log
line). So ``config.json`` names rnnify's architecture (``model_type`` ``rnnify``, ``auto_map`` to
``modeling_rnnify.py``) and keeps the source config whole under ``source_config``; transformers
loads the directory with ``trust_remote_code=True`` (or without it once
``rnnify.integrations.transformers`` is imported) and refuses it otherwise. Directories written
before this keep the source config as ``config.json``; ``source_config`` reads both.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

CONFIG_FILE = "config.json"
MODELING_FILE = "modeling_rnnify.py"
MODEL_TYPE = "rnnify"
ARCHITECTURE = "RnnifyForCausalLM"
# vLLM's model class for a directory with exact attention (rnnify.integrations.vllm), named by the
# config class vLLM reads, never written to config.json
PAGED_ARCHITECTURE = "RnnifyPagedForCausalLM"
AUTO_MAP = {
    "AutoConfig": f"{Path(MODELING_FILE).stem}.RnnifyConfig",
    "AutoModelForCausalLM": f"{Path(MODELING_FILE).stem}.{ARCHITECTURE}",
}
# Copied from the source config so tools that read only the top level (generation defaults,
# tokenizer lookup, lm-eval's max length) find them.
_TOP_LEVEL = (
    "vocab_size",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "max_position_embeddings",
    "tokenizer_class",
)


def is_wrapped(config: dict[str, Any]) -> bool:
    return config.get("model_type") == MODEL_TYPE and isinstance(config.get("source_config"), dict)


def wrap_config(source: bytes, manifest: dict[str, Any]) -> bytes:
    """``config.json`` of a converted directory, from the source model's ``config.json`` bytes."""
    from rnnify import __version__

    config = json.loads(source)
    if is_wrapped(config):  # a model loaded from a new directory keeps the unwrapped source; be safe anyway
        config = config["source_config"]
    wrapped = canonical_fields(config, _TOP_LEVEL)
    graph_limit = (manifest.get("positions") or {}).get("graph_limit")
    if graph_limit is not None:  # what transformers, lm-eval and vLLM take for the longest sequence
        wrapped["max_position_embeddings"] = min(wrapped.get("max_position_embeddings", graph_limit), graph_limit)
    wrapped.update(
        model_type=MODEL_TYPE,
        architectures=[ARCHITECTURE],
        auto_map=dict(AUTO_MAP),
        rnnify_version=__version__,
        target=manifest.get("target"),
        dtype=manifest.get("dtype"),
        source_config=config,
    )
    return (json.dumps(wrapped, indent=2) + "\n").encode()


def canonical_fields(config: dict[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    """The values of ``keys``, transformers' common names for them, that the source config ``config``
    (its ``config.json`` as a dict) states. A config class may store a field under a name of its own
    (GPT-2's ``n_positions`` for ``max_position_embeddings``, BLOOM's ``n_head``: its
    ``attribute_map``) or compute it from others (Falcon's ``head_dim``, a property); tools that read a
    converted directory's ``config.json`` (lm-eval, vLLM) look for the common name. A key the source
    leaves to its class's default stays out: where the class of its ``model_type`` is not this
    transformers', the dict is all there is."""
    kind = _config_class(config.get("model_type"))
    aliases = getattr(kind, "attribute_map", None) or {}
    found, instance = {}, None
    for key in keys:
        if key in config:
            found[key] = config[key]
        elif aliases.get(key) in config:
            found[key] = config[aliases[key]]
        elif isinstance(getattr(kind, key, None), property):
            instance = instance or _config_object(config)
            value = getattr(instance, key, None) if instance is not None else None
            if value is not None:
                found[key] = value
    return found


def _config_class(model_type: Any):
    """The transformers config class of ``model_type``; None where this transformers has none."""
    from transformers import CONFIG_MAPPING

    try:
        return CONFIG_MAPPING[model_type]
    except (KeyError, TypeError):
        return None


def _config_object(config: dict[str, Any]):
    """``config`` as an instance of its ``model_type``'s transformers config class; None where no class
    of this transformers takes it."""
    from transformers import AutoConfig

    fields = dict(config)
    try:
        return AutoConfig.for_model(fields.pop("model_type"), **fields)
    except Exception:  # noqa: BLE001 - an unknown type, or values its class refuses: the dict as it is
        return None


def source_config(data: bytes) -> bytes:
    """The source model's ``config.json`` from a converted directory's (either format)."""
    try:
        config = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return data
    if isinstance(config, dict) and is_wrapped(config):
        return (json.dumps(config["source_config"], indent=2) + "\n").encode()
    return data


def modeling_file() -> bytes:
    """The loader transformers runs for ``trust_remote_code=True`` (``rnnify/integrations/modeling_rnnify.py``)."""
    return (Path(__file__).parents[1] / "integrations" / MODELING_FILE).read_bytes()


def source_pretrained_config(directory: Path):
    """The source's config as a transformers config object, for a converted ``directory``; None for others.

    ``AutoTokenizer.from_pretrained(directory, config=...)`` then chooses the tokenizer as it would
    for the source model, and never reads ``config.json``'s ``auto_map`` (in a process that has not
    imported ``rnnify.integrations.transformers``, that would make transformers ask on stdin, for
    15 seconds, whether to run ``modeling_rnnify.py``).
    """
    try:
        config = json.loads((Path(directory) / CONFIG_FILE).read_bytes())
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(config, dict) or not is_wrapped(config):
        return None
    from transformers import PreTrainedConfig

    # a source config that no class takes: the tokenizer is chosen without it
    return _config_object(config["source_config"]) or PreTrainedConfig()
