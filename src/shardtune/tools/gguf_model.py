"""What llama.cpp knows of a Hugging Face model: its family (how convert_hf_to_gguf converts it), its
hyper-parameters under llama.cpp's keys, and its rope (Llama 3's as the ``rope_freqs`` tensor)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from shardtune.errors import ShardtuneError
from shardtune.tools import gguf_gemma3


class ExportError(ShardtuneError, ValueError):
    """The model or the options cannot be exported; the message names what and why."""


@dataclass(frozen=True)
class Family:
    arch: str  # gguf's MODEL_ARCH member name
    permute_qk: bool = False
    norm_plus_one: bool = False
    multimodal: bool = False  # the text model of a vision-language checkpoint is exported


# Hugging Face model_type -> how llama.cpp converts it.
FAMILIES = {
    "llama": Family("LLAMA", permute_qk=True),
    "mistral": Family("LLAMA", permute_qk=True),
    "qwen2": Family("QWEN2"),
    "qwen3": Family("QWEN3"),
    "gemma": Family("GEMMA", norm_plus_one=True),
    "gemma2": Family("GEMMA2", norm_plus_one=True),
    "gemma3_text": Family("GEMMA3", norm_plus_one=True),
    "gemma3": Family("GEMMA3", norm_plus_one=True, multimodal=True),
}
TIED_ARCHS = ("GEMMA", "GEMMA2", "GEMMA3")  # llama.cpp has no output tensor for these: the embedding serves


def rope_theta(config: dict) -> float:
    """The (global layers') rope base."""
    return float(_rope_params(config).get("rope_theta", config.get("rope_theta", 10000.0)))


def _rope_params(config: dict) -> dict:
    """The rope scaling entry (transformers 5: ``rope_parameters``; older files: ``rope_scaling``)."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    return params.get("full_attention", params)


def _rope_kind(config: dict) -> str:
    params = _rope_params(config)
    return str(params.get("rope_type", params.get("type")) or "default").lower()


def llama3_rope_freqs(config: dict):
    """Llama 3's rope as llama.cpp reads it: one divisor per rotary frequency, the ``rope_freqs`` tensor.

    llama.cpp rotates by ``pos * theta_i / rope_freqs[i]``, so each entry is the base frequency over
    the scaled one: 1 above the high-frequency bound, ``factor`` below the low one, and in between
    the smooth interpolation of Llama 3.1's reference code (convert_hf_to_gguf's LlamaModel).
    Returns None for any other rope type.
    """
    import numpy as np

    if _rope_kind(config) != "llama3":
        return None
    params = _rope_params(config)
    dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    freqs = 1.0 / (rope_theta(config) ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor = float(params.get("factor", 8.0))
    low, high = float(params.get("low_freq_factor", 1.0)), float(params.get("high_freq_factor", 4.0))
    old_context = float(params.get("original_max_position_embeddings", 8192))
    divisors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old_context / high:
            divisors.append(1.0)
        elif wavelen > old_context / low:
            divisors.append(factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(divisors, dtype=np.float32)


def add_hparams(writer, config: dict, family: Family, quant: str, name: str) -> None:
    """The model's shape under llama.cpp's keys (convert_hf_to_gguf's TextModel.set_gguf_parameters)."""
    import gguf

    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    writer.add_name(name)
    writer.add_file_type({"f16": gguf.LlamaFileType.MOSTLY_F16, "bf16": gguf.LlamaFileType.MOSTLY_BF16,
                          "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[quant])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(config.get("num_key_value_heads") or heads)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(rope_theta(config))
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_vocab_size(config["vocab_size"])
    if family.permute_qk:
        writer.add_rope_dimension_count(head_dim)
    if family.arch == "GEMMA2":
        writer.add_attn_logit_softcapping(config.get("attn_logit_softcapping") or 0.0)
        writer.add_final_logit_softcapping(config.get("final_logit_softcapping") or 0.0)
        writer.add_sliding_window(config.get("sliding_window") or 0)
    if family.arch == "GEMMA3":
        gguf_gemma3.add_hparams(writer, config)
    kind = _rope_kind(config)
    if kind == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(_rope_params(config)["factor"]))
    elif kind == "llama3" and family.permute_qk:
        pass  # the rope_freqs tensor carries it; llama.cpp reads no scaling keys for it
    elif kind != "default":
        supported = "default, linear, llama3 (llama and mistral)"
        raise ExportError(f"config.json: rope scaling {kind!r} is not one this GGUF export writes ({supported})")
