"""Writing tiny GGUF files with the ``gguf`` package's writer, so GGUF tests need no download.

``write_tiny_llama`` lays a random Hugging Face llama out the way llama.cpp's converter does
(tensor names ``blk.N.attn_q.weight``..., q and k rows permuted for its rotary layout, F32 data)
with a byte-level BPE tokenizer and a ChatML chat template in the metadata.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MERGES = ["h e", "l l", "Ġ t"]
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
HEADS, KV_HEADS, WIDTH, LAYERS, FFN, CONTEXT = 4, 2, 64, 2, 128, 256

_TOP = {"model.embed_tokens.weight": "token_embd", "model.norm.weight": "output_norm", "lm_head.weight": "output"}
_LAYER = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def tokens() -> list[str]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return list(bytes_to_unicode().values()) + [m.replace(" ", "") for m in MERGES] + SPECIAL


def _permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's row order for q and k (its rotary pairs halves differently); transformers undoes it."""
    return (
        weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )


def write_tiny_llama(
    path: Path, *, tokenizer: bool = True, architecture: str = "llama", quantize: str | None = None, seed: int = 0
) -> Path:
    """Write a random 2-layer, 64-wide llama to GGUF file ``path``; returns ``path``.

    ``quantize`` (e.g. ``"Q4_1"``) stores the layers' matrices in that GGUF block format, as
    quantised files on the hub do; the rest stays F32.
    """
    import gguf
    from transformers import LlamaConfig, LlamaForCausalLM

    vocab = tokens()
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=WIDTH,
        intermediate_size=FFN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=CONTEXT,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_name("tiny llama")
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(WIDTH)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(WIDTH // HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(len(vocab))
    if tokenizer:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(vocab)
        writer.add_token_types([1] * (len(vocab) - len(SPECIAL)) + [3] * len(SPECIAL))  # 3: control
        writer.add_token_merges(MERGES)
        writer.add_bos_token_id(vocab.index("<|im_start|>"))
        writer.add_eos_token_id(vocab.index("<|im_end|>"))
        writer.add_chat_template(CHAT_TEMPLATE)
    for name, tensor in model.state_dict().items():
        data = tensor.numpy().astype(np.float32)
        if name in _TOP:
            gguf_name = _TOP[name]
        else:
            _, _, layer, *rest = name.split(".")
            module = ".".join(rest[:-1])
            gguf_name = f"blk.{layer}.{_LAYER[module]}"
            if module == "self_attn.q_proj":
                data = _permute(data, HEADS)
            elif module == "self_attn.k_proj":
                data = _permute(data, KV_HEADS)
        data = np.ascontiguousarray(data)
        if quantize is not None and gguf_name.startswith("blk.") and data.ndim == 2:
            qtype = gguf.GGMLQuantizationType[quantize]
            writer.add_tensor(gguf_name + ".weight", gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name + ".weight", data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
