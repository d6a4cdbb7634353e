"""Tiny random models of every causal-LM (and vision- or audio-language) architecture of transformers, for ``arch_sweep.py``.

``build(name)`` makes a model type's config tiny (2 layers of each distinct kind, 64 wide: every
size-like attribute shrunk, per-layer lists cut to the layers kept), then applies ``SPECIAL`` (what a
type needs beyond the generic rules) and, for a job ``TYPE@VARIANT``, ``VARIANTS`` (a released
checkpoint's layout its defaults do not build). Tests import ``build`` to convert the same models.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, PretrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from make_tiny_model import tiny_config  # noqa: E402

VOCAB = 256

# --------------------------------------------------------------------------- tiny configs
# attribute -> value, set wherever a config (or sub-config) has it as an int
SIZES = {
    **dict.fromkeys(("vocab_size",), VOCAB),
    **dict.fromkeys(
        (
            "hidden_size",
            "d_model",
            "n_embd",
            "embed_dim",
            "dim",
            "model_dim",
            "word_embed_proj_dim",
            "hidden_size_global",
            "lru_width",
            "emb_dim",
            # widths a composite's parts must share with the text model (its validators check them)
            "out_hidden_size",
            "text_hidden_size",
            "audio_hidden_size",
            "adapter_out_dim",
            "codebook_dim",
        ),
        64,
    ),
    **dict.fromkeys(("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers"), 2),
    **dict.fromkeys(
        (
            "num_attention_heads",
            "n_head",
            "n_heads",
            "num_heads",
            "decoder_attention_heads",
            "attention_heads",
            "swa_num_attention_heads",
        ),
        4,
    ),
    **dict.fromkeys(
        (
            "num_key_value_heads",
            "num_kv_heads",
            "n_kv_heads",
            "kv_n_heads",
            "multi_query_group_num",
            "num_query_groups",
            "swa_num_key_value_heads",
        ),
        2,
    ),
    **dict.fromkeys(
        (
            "head_dim",
            "d_head",
            "attention_head_dim",
            "dim_head",
            "kv_channels",
            "attention_head_size",
            "swa_head_dim",
            "d_kv",
            "v_head_dim",
            "qk_head_dim",
            "index_head_dim",
        ),
        16,
    ),
    **dict.fromkeys(
        (
            "intermediate_size",
            "ffn_dim",
            "n_inner",
            "decoder_ffn_dim",
            "ffn_hidden_size",
            "d_ff",
            "dff",
            "intermediate_size_mlp",
            "dense_intermediate_size",
            "first_dense_intermediate_size",
            "mlp_dim",
            "feed_forward_size",
            "dim_ff",
            "d_inner",
        ),
        128,
    ),
    **dict.fromkeys(
        (
            "moe_intermediate_size",
            "shared_expert_intermediate_size",
            "shared_intermediate_size",
            "moe_shared_expert_intermediate_size",
            "expert_ffn_hidden_size",
            "shared_experts_intermediate_size",
            "mlp_only_intermediate_size",
        ),
        32,
    ),
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"), 4),
    **dict.fromkeys(("num_experts_per_tok", "num_experts_per_token", "moe_k", "moe_top_k", "moe_topk"), 2),
    **dict.fromkeys(("n_shared_experts", "num_shared_experts", "moe_num_shared_experts"), 1),
    **dict.fromkeys(("n_group", "num_expert_group"), 2),
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "kv_lora_rank": 16,
    "q_lora_rank": 32,
    "o_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "rotary_dim": 8,
    "index_n_heads": 2,
    "index_num_heads": 2,
    **dict.fromkeys(("linear_num_key_heads", "linear_num_heads"), 2),
    "linear_num_value_heads": 4,
    **dict.fromkeys(("linear_key_head_dim", "linear_value_head_dim", "linear_head_dim"), 16),
    **dict.fromkeys(("state_size", "ssm_state_size", "mamba_d_state"), 8),
    **dict.fromkeys(("mamba_n_heads", "mamba_num_heads", "n_mamba_heads"), 4),
    **dict.fromkeys(("mamba_d_head", "mamba_head_dim", "mamba_headdim"), 32),
    **dict.fromkeys(("n_groups", "mamba_n_groups", "mamba_ngroups"), 1),
    "mamba_d_ssm": 128,
    **dict.fromkeys(
        (
            "unpadded_vocab_size",
            "vocab_size_per_layer_input",
            "encoder_hash_byte_group_vocab",
            "decoder_vocab_size",
            "pronunciation_vocab_size",
            "shape_vocab_size",
        ),
        VOCAB,
    ),
    **dict.fromkeys(("pronunciation_embed_dim", "shape_embed_dim"), 16),
}
# set even where the default is None (a None that the model code divides by or indexes with)
SET_NONE = {"head_dim", "num_key_value_heads", "num_experts_per_tok", "n_routed_experts", "n_shared_experts"}
CAPS = {  # attribute -> upper bound, applied only where the default is larger
    **dict.fromkeys(("max_position_embeddings", "n_positions", "n_ctx", "max_target_positions", "max_seq_len"), 128),
    **dict.fromkeys(("sliding_window", "sliding_window_size", "attention_window_size", "attention_chunk_size"), 8),
    "hidden_size_per_layer_input": 16,
}
# lists of layer indices (remapped to the layers kept; the others dropped), and per-layer lists whose values are indices
INDEX_LISTS = {"index_layers", "mlp_only_layers", "moe_layers", "cross_attention_layers", "full_attn_idxs"}
INDEX_VALUED = {"kv_source_layers"}
# targets given a window (shorter than the 24 tokens compared) where they need one or have a longer default
TARGET_OPTIONS = {target: {"window": 8} for target in ("window", "hybrid", "select", "lola")}
SPECIAL_TOKENS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
# per model type, set after the generic rules (the names listed in a layer-types list are kept too)
SPECIAL: dict[str, dict] = {
    "bamba": {"attn_layer_indices": [1]},  # a default config has no attention layer
    "granitemoehybrid": {"layer_types": ["linear_attention", "full_attention"]},
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 1},
    "recurrent_gemma": {"block_types": ["recurrent", "attention"], "attention_window_size": 8},  # default: 2 recurrent
    "zamba": {
        "num_hidden_layers": 4,
        "attn_layer_period": 2,
        "attn_layer_offset": 1,
        "layers_block_type": ["linear_attention", "hybrid"] * 2,
    },
    "dbrx": {"attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0}},
    "dots3_note_text": {"num_key_value_heads": 4, "head_dim": 16},
    "dots3_note": {"num_key_value_heads": 4, "head_dim": 16, "adapter_in_dim": 64, "adapter_input_size": 64},
    **dict.fromkeys(("musicgen", "musicgen_melody"), {"num_codebooks": 1}),
    "mamba2": {"head_dim": 32},
    "zaya": {"num_experts_per_tok": 1},
    "reformer": {"is_decoder": True, "axial_pos_embds": False},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
    "gemma3n_text": {"num_kv_shared_layers": 0},
    **dict.fromkeys(
        ("gemma4_assistant", "gemma4_unified_assistant"),
        {  # its defaults fail its own checks
            "hidden_size_per_layer_input": 0,
            "vocab_size_per_layer_input": 0,
            "num_kv_shared_layers": 2,
            "num_hidden_layers": 2,  # every layer shared
        },
    ),
    "qwen4_exp_text": {
        "indexer_n_heads": 2,
        "indexer_kv_heads": 1,
        "indexer_head_dim": 16,
        "indexer_budget": 8,
        "indexer_compress_ratio": 4,
    },
    # audio encoders of 20 heads, which a tiny width does not divide
    **dict.fromkeys(
        ("qwen2_audio", "qwen2_5_omni", "qwen2_5_omni_thinker", "qwen3_omni_moe", "qwen3_omni_moe_thinker"),
        {"encoder_attention_heads": 4},
    ),
    "cohere_compass_text": {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
    "mistral4": {"head_dim": 16},  # query/key head: nope + rope parts (the rotary factor is a share of it)
    "glm5_next_text": {"qk_rope_head_dim": 0},  # its sparse layers have no rotary part
    "deepseek_ocr2_text": {"mlp_layer_types": ["dense", "sparse"]},
    "step3p7": {"sliding_window": 8},  # its text layers slide, with no default window
    "diffusion_gemma_text": {"num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 32},
    "chameleon": {"vocabulary_map": {"<image>": VOCAB - 1}},
    "granite4_vision": {
        "deepstack_layer_map": [[0, 0], [1, 1]],
        "spatial_target_layers": [0, 0, 1, 1],
        "downsample_rate": "2/4",
    },
    "fun_asr_nano": {"adaptor_config": {"intermediate_size": 16}},  # a quarter of the text width
    # multimodal RoPE sections (rotary pairs per position axis) of a 16-wide head, where the modeling code
    # has its own default: height and width the same size in Ernie's interleaving
    "ernie4_5_vl_moe_text": {
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [3, 3, 2]}
    },
    "paddleocr_vl_text": {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 3, 3]}},
    "molmo2_adapter": {"vision_feature_layer": [-1]},
    "muse_spark_audio": {"num_hidden_layers": 4, "hidden_sizes": [16, 16, 32, 64]},
    "nemotron3_5_transcribe_word_timestamp": {"blank_token_id": VOCAB - 1},
    # token ranges inside the vocabulary: images, then audio
    "apertus1p5": {"image_token_offset": 128, "audio_token_offset": 192},
    **dict.fromkeys(("apertus1p5_vision_tokenizer", "wavtokenizer_encoder"), {"codebook_size": 64}),
}

# job "MODEL_TYPE@VARIANT" -> constructor arguments set over the tiny config of MODEL_TYPE
VARIANTS: dict[str, dict] = {
    # Falcon-RW (tiiuae/falcon-rw-1b, -7b): ALiBi, one fused query/key/value per head, a kv head per
    # head (num_kv_heads None: as many as the query heads)
    "falcon@alibi": {
        "alibi": True,
        "multi_query": False,
        "num_kv_heads": None,
        "new_decoder_architecture": False,
        "parallel_attn": False,
        "bias": True,
    },
    # XLM as its causal language modelling objective trains it (CLM): a triangular mask
    "xlm@causal": {"causal": True},
}


def _keep_layers(types: list) -> list[int]:
    """Indices of the layers kept: the first of each distinct type (at most 4), then the first ones, 2 at least."""
    keep = sorted({str(t): i for i, t in reversed(list(enumerate(types)))}.values())[:4]
    keep += [i for i in range(len(types)) if i not in keep][: max(0, 2 - len(keep))]
    return sorted(keep)


def _tiny(values: dict, mla: bool) -> dict:
    """One layer's ``per_layer_config`` entry with its sizes shrunk."""
    out = {k: SIZES[k] if k in SIZES and isinstance(v, int) else v for k, v in values.items()}
    if mla and "num_key_value_heads" in out:
        out["num_key_value_heads"] = out.get("num_attention_heads", SIZES["num_attention_heads"])
    return out


def _mrope_section(section: list[int] | None, out: dict, rope: dict) -> list[int]:
    """Multimodal RoPE's rotary pairs per position axis, scaled to the tiny head's (summing to them)."""
    section = section or [16, 24, 24]
    head_dim = out.get("head_dim") or out.get("hidden_size", SIZES["hidden_size"]) // out.get("num_attention_heads", 4)
    pairs = int(head_dim * rope.get("partial_rotary_factor", 1.0)) // 2
    scaled = [part * pairs // sum(section) for part in section]
    return [*scaled[:-1], scaled[-1] + pairs - sum(scaled)]


def overrides(config, model_type: str) -> dict:
    """Constructor arguments that make ``config`` (and its sub-configs) tiny: every size-like attribute set
    (``SIZES``, ``CAPS``), per-layer lists cut to the layers kept, then ``SPECIAL[model_type]``."""
    layers_before = next(
        (
            getattr(config, k)
            for k in ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
            if isinstance(getattr(config, k, None), int)
        ),
        0,
    )
    lists = [k for k, v in vars(config).items() if isinstance(v, list) and len(v) == layers_before > 2]
    typed = next(
        (k for k in ("layer_types", "layers_block_type", "block_types", "attention_types") if k in lists),
        lists[0] if lists else None,
    )
    keep = _keep_layers(getattr(config, typed)) if typed else None
    out: dict = {}
    for key, value in vars(config).items():
        if isinstance(value, PretrainedConfig):
            out[key] = {**value.to_diff_dict(), **overrides(value, model_type), "model_type": value.model_type}
        elif isinstance(value, bool) or key.startswith("_"):
            continue
        elif key in SIZES and (isinstance(value, int) or (value is None and key in SET_NONE)):
            out[key] = SIZES[key]
        elif key in CAPS and isinstance(value, int) and value > CAPS[key]:
            out[key] = CAPS[key]
        elif key in SPECIAL_TOKENS and isinstance(value, (int, list)):
            out[key] = SPECIAL_TOKENS[key]
    mla = isinstance(out.get("kv_lora_rank"), int)
    if mla:  # multi-head latent attention: head_dim is the rotary part, a kv head per head
        out.update(head_dim=out.get("qk_rope_head_dim", 8), num_key_value_heads=out.get("num_attention_heads", 4))
    if keep is not None:
        new = {old: i for i, old in enumerate(keep)}
        out.update({key: [getattr(config, key)[i] for i in keep] for key in lists})
        out.update({k: [new[i] for i in out[k] if i in new] for k in INDEX_VALUED if k in out})
        out.update({k: len(keep) for k in ("num_hidden_layers", "n_layer", "num_layers", "n_layers") if k in out})
        for key, value in vars(config).items():
            if key in INDEX_LISTS and isinstance(value, list):
                out[key] = [new[i] for i in value if i in new]
        per_layer = config.to_dict().get("per_layer_config")  # {"05": {"head_dim": 512}, ...}: layers unlike the rest
        if isinstance(per_layer, dict):
            out["per_layer_config"] = {new[int(k)]: _tiny(v, mla) for k, v in per_layer.items() if int(k) in new}
    rope = getattr(config, "rope_parameters", None)
    if isinstance(rope, dict) and "mrope_section" in getattr(config, "ignore_keys_at_rope_validation", ()):
        # multimodal RoPE's rotary pairs per position axis (a default of the modeling code where unset)
        out["rope_parameters"] = {**rope, "mrope_section": _mrope_section(rope.get("mrope_section"), out, rope)}
    if hasattr(config, "is_decoder"):
        out["is_decoder"] = True  # an encoder family's *ForCausalLM: what its own docs ask for, causal attention
    for key, value in {**SPECIAL.get(config.model_type, {}), **SPECIAL.get(model_type, {})}.items():
        sub = isinstance(vars(config).get(key), PretrainedConfig)  # a sub-config's go over its tiny values
        out[key] = {**out[key], **value} if sub else value
    return out


def build(name: str):
    """(tiny random model in eval mode, its class name) for job ``name``: a model type, or a variant of one."""
    model_type = name.partition("@")[0]
    class_name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type) or MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES[model_type]
    config_class = getattr(transformers, CONFIG_MAPPING_NAMES[model_type])
    model_class = getattr(transformers, class_name)
    try:
        default = config_class()
    except Exception:  # noqa: BLE001  (a default that fails its own checks: the special values may mend it)
        text = {"model_type": "gemma4_text", **SPECIAL[model_type]} if "assistant" in model_type else None
        default = config_class(**({"text_config": text} if text else {}))
    config = config_class(**{**overrides(default, model_type), **VARIANTS.get(name, {})})
    if not isinstance(config, model_class.config_class):  # e.g. Llama4ForCausalLM takes the text config
        config = next((v for v in vars(config).values() if isinstance(v, model_class.config_class)), config)
    torch.manual_seed(0)
    model = model_class(config).eval()
    if hasattr(model, "set_default_language"):  # X-MOD
        model.set_default_language("en_XX")
    return model, class_name


def tiny_example(arch: str):
    """Tiny ``arch`` (llama or gpt2) of ``examples/make_tiny_model.py``."""
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config(arch)).eval()
