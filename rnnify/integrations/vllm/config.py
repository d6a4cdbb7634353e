"""``config.json`` of a converted directory as vLLM reads it.

The directory's ``config.json`` names ``model_type`` ``rnnify`` and keeps the source model's config
under ``source_config`` (``runtime.hf_files``). vLLM sizes some of its buffers and logs from the
top-level fields of a transformers config (``hidden_size``, ``num_hidden_layers``...), so this class
lifts those from the source config, by their common names (``hf_files.canonical_fields``: GPT-2's
``n_embd`` is read as ``hidden_size``). Registering it (``register``) lets vLLM read the directory
without ``trust_remote_code``. A directory with exact attention names the hybrid model class
(``hf_files.PAGED_ARCHITECTURE``): vLLM reads a model class's kind before it builds the model; its
pages take their head size and kv heads from the exact sites, not from the source config.
"""

from __future__ import annotations

from pathlib import Path

from transformers import PreTrainedConfig

from rnnify.runtime import hf_files
from rnnify.runtime.manifest import MANIFEST_FILE

__all__ = ["LIFTED", "RnnifyVllmConfig"]

# Fields of the source config that vLLM reads from the top level when they are not there already.
LIFTED = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "tie_word_embeddings",
    "bos_token_id",
    "eos_token_id",
)


class RnnifyVllmConfig(PreTrainedConfig):
    model_type = hf_files.MODEL_TYPE
    source_config: dict | None = None
    vocab_size: int = 0

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        for key, value in hf_files.canonical_fields(self.source_config or {}, LIFTED).items():
            if getattr(self, key, None) is None:
                setattr(self, key, value)
        where = getattr(self, "_name_or_path", "")
        if where and (Path(where) / MANIFEST_FILE).is_file():
            from rnnify.integrations.vllm.hosting import exact_sites, read_manifest

            sites = exact_sites(read_manifest(where))
            if sites:
                self.architectures = [hf_files.PAGED_ARCHITECTURE]
                # vLLM sizes the pages from these two: make them hold what the exact sites keep
                # (``hosting.check_hostable`` refuses sites that no one size holds)
                widths = {site.spec.head_dim for site in sites}
                if len(widths) == 1:
                    self.head_dim = widths.pop()
                self.num_key_value_heads = max(site.spec.num_kv_heads for site in sites)
