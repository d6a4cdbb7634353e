"""vLLM plugin: ``vllm.LLM(dir)`` and vLLM's OpenAI server run a directory written by ``rnnify convert``.

vLLM calls ``register`` in each of its processes through the ``vllm.general_plugins`` entry point
that rnnify's package declares (so rnnify installed beside vLLM is enough). It registers, under
names vLLM looks up:

- the config class for ``model_type`` ``rnnify`` (``config.RnnifyVllmConfig``), so the directory
  loads without ``trust_remote_code``;
- the model class for the architecture ``RnnifyForCausalLM`` that the directory's ``config.json``
  names (``model.RnnifyForCausalLM``, imported by vLLM only when it builds the model);
- vLLM's config hook for state-cache models (Mamba's), which gives each sequence one state slot.

docs/serving.md says how to install and serve, and what is supported.
"""

from __future__ import annotations

from rnnify.runtime import hf_files

__all__ = ["register"]

MODEL_CLASS = "rnnify.integrations.vllm.model:RnnifyForCausalLM"


def register() -> None:
    """Register rnnify's config and model classes with vLLM (idempotent)."""
    from transformers import AutoConfig
    from vllm import ModelRegistry

    from rnnify.integrations.vllm.config import RnnifyVllmConfig

    AutoConfig.register(hf_files.MODEL_TYPE, RnnifyVllmConfig, exist_ok=True)
    try:  # vLLM's own table of config classes: it then also treats the type as local code
        from vllm.transformers_utils.config import _CONFIG_REGISTRY

        _CONFIG_REGISTRY[hf_files.MODEL_TYPE] = RnnifyVllmConfig
    except ImportError:
        pass
    if hf_files.ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(hf_files.ARCHITECTURE, MODEL_CLASS)
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP, MambaModelConfig

    class RnnifyModelConfig(MambaModelConfig):
        """Refuses a directory whose state vLLM cannot hold (``hosting``), then Mamba's settings:
        one state slot per sequence (``mamba_block_size`` = ``max_model_len``), no prefix caching."""

        @classmethod
        def verify_and_update_config(cls, vllm_config) -> None:
            from rnnify.errors import RnnifyError
            from rnnify.integrations.vllm.hosting import check_hostable

            check_hostable(vllm_config.model_config.model)
            if vllm_config.cache_config.enable_prefix_caching:
                raise RnnifyError(
                    "rnnify's vLLM plugin does not support prefix caching yet: drop --enable-prefix-caching"
                )
            super().verify_and_update_config(vllm_config)

    MODELS_CONFIG_MAP[hf_files.ARCHITECTURE] = RnnifyModelConfig
