"""vLLM plugin: ``vllm.LLM(dir)`` and vLLM's OpenAI server run a directory written by ``rnnify convert``.

vLLM calls ``register`` in each of its processes through the ``vllm.general_plugins`` entry point
that rnnify's package declares (so rnnify installed beside vLLM is enough). It registers, under
names vLLM looks up:

- the config class for ``model_type`` ``rnnify`` (``config.RnnifyVllmConfig``), so the directory
  loads without ``trust_remote_code``;
- the model classes for the architecture ``RnnifyForCausalLM`` that the directory's ``config.json``
  names (``model.RnnifyForCausalLM``), and for ``RnnifyPagedForCausalLM``, which the config names
  instead where the model has exact attention (``model.RnnifyPagedForCausalLM``: ``paged``);
  vLLM imports them only when it builds the model;
- vLLM's config hook for state-cache models (Mamba's), which gives each sequence one state slot.

docs/serving.md says how to install and serve, and what is supported.
"""

from __future__ import annotations

from rnnify.runtime import hf_files

__all__ = ["register"]

MODEL_CLASSES = {
    hf_files.ARCHITECTURE: "rnnify.integrations.vllm.model:RnnifyForCausalLM",
    hf_files.PAGED_ARCHITECTURE: "rnnify.integrations.vllm.model:RnnifyPagedForCausalLM",
}


def register() -> None:
    """Register rnnify's config and model classes with vLLM (idempotent)."""
    import torch
    from transformers import AutoConfig
    from vllm import ModelRegistry

    from rnnify.integrations.vllm.config import RnnifyVllmConfig

    AutoConfig.register(hf_files.MODEL_TYPE, RnnifyVllmConfig, exist_ok=True)
    try:  # vLLM's own table of config classes: it then also treats the type as local code
        from vllm.transformers_utils.config import _CONFIG_REGISTRY

        _CONFIG_REGISTRY[hf_files.MODEL_TYPE] = RnnifyVllmConfig
    except ImportError:
        pass
    for architecture, model_class in MODEL_CLASSES.items():
        if architecture not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(architecture, model_class)
    from vllm.logger import init_logger
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP, MambaModelConfig

    # a child of vLLM's logger: vLLM configures only its own tree, so its handler and format show these lines
    logger = init_logger("vllm.plugins.rnnify")

    class RnnifyModelConfig(MambaModelConfig):
        """Refuses a directory whose state vLLM cannot hold (``hosting``), then Mamba's settings:
        one state slot per sequence (``mamba_block_size`` = ``max_model_len``), no prefix caching:
        refused for a model of state slots alone (where vLLM's default is off, so it was asked
        for), turned off for the paged one (vLLM's default for hybrid models is on, and asked for
        or not cannot be told apart). vLLM sizes a hybrid model's pages to its state slots later,
        once the layers exist."""

        @classmethod
        def verify_and_update_config(cls, vllm_config) -> None:
            from pathlib import Path

            from rnnify.errors import RnnifyError
            from rnnify.integrations.vllm.hosting import check_hostable
            from rnnify.runtime import integrity
            from rnnify.runtime.manifest import read_data
            from rnnify.runtime.storage import READ_IF_PRESENT
            from rnnify.runtime.tokenizer import check_tokenizer_files

            model_config = vllm_config.model_config
            # vLLM reads the tokenizer and config files itself (rnnify.load, which checks them too,
            # builds only the model): the recorded ones, and nothing a tokenizer would read elsewhere
            directory = Path(model_config.model)
            integrity.check(directory, read_data(directory), (), READ_IF_PRESENT)
            check_tokenizer_files(directory)
            manifest = check_hostable(
                model_config.model,
                head_size=model_config.get_head_size(),
                num_kv_heads=model_config.get_num_kv_heads(vllm_config.parallel_config),
            )
            cache_config = vllm_config.cache_config
            if cache_config.cache_dtype != "auto":
                raise RnnifyError(
                    f"rnnify's vLLM plugin keeps the model's own dtype ({manifest.dtype}) in its caches: "
                    f"drop --kv-cache-dtype {cache_config.cache_dtype}"
                )
            # vLLM's buffers and pages in the dtype the model runs in (vLLM's CPU default is bfloat16)
            dtype = getattr(torch, manifest.dtype)
            if model_config.dtype != dtype:
                logger.info(
                    "rnnify: the model runs in %s, the dtype it was converted to, not vLLM's %s "
                    "(rnnify convert --dtype converts to another)",
                    manifest.dtype,
                    str(model_config.dtype).removeprefix("torch."),
                )
                model_config.dtype = dtype
            if cache_config.mamba_ssm_cache_dtype == "auto":
                # the states keep the dtypes the model declares (``get_state_dtype``) whatever this
                # says; float32 is what vLLM's CPU platform would set, warning of a "GDN backend 'rnnify'"
                cache_config.mamba_ssm_cache_dtype = "float32"
            if cache_config.enable_prefix_caching and model_config.is_hybrid:
                logger.warning("rnnify's vLLM plugin does not support prefix caching yet: turning it off")
                cache_config.enable_prefix_caching = False
            if cache_config.enable_prefix_caching:
                raise RnnifyError(
                    "rnnify's vLLM plugin does not support prefix caching yet: drop --enable-prefix-caching"
                )
            super().verify_and_update_config(vllm_config)

    for architecture in MODEL_CLASSES:
        MODELS_CONFIG_MAP[architecture] = RnnifyModelConfig
