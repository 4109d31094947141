"""Gemma 3 as llama.cpp's ``gemma3`` architecture: what its text model needs beyond the common keys.

llama.cpp's GEMMA3 does not read all of its shape from the file. Given a sliding window, it makes
every sixth layer global and the five before it sliding (transformers' default ``layer_types``),
ropes the sliding layers with base 10000 and no scaling (the file's rope base and linear scaling
are the global layers'), and scales queries by 1/sqrt(head_dim), or 1/sqrt(hidden/heads) for its
62-layer 27B, instead of reading ``query_pre_attn_scalar``. A config that differs would load there
and run as another model, so export refuses it, naming the key. The keys are written as
convert_hf_to_gguf.py's Gemma3Model writes them: the sliding window (left out when no layer slides,
which llama.cpp reads as all layers global), the sliding layers' rope base, the final logit
softcapping when the config has one.

The multimodal ``gemma3`` checkpoint (Gemma3ForConditionalGeneration: Gemma 3 4B, 12B, 27B) is
written as its text model, as convert_hf_to_gguf.py writes it: the vision tower and projector stay
out (llama.cpp reads them from a separate mmproj file, which this export does not write).
"""

from __future__ import annotations

SWA_PERIOD = 6  # llama.cpp: set_swa_pattern(6)
LOCAL_ROPE_BASE = 10000.0  # llama.cpp: rope_freq_base_train_swa
_TEXT_PREFIXES = ("language_model.model.", "model.language_model.")  # transformers 4 and 5 spellings
_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


def text_config(model_dir) -> dict:
    """The text model's config with transformers' defaults filled in: Gemma 3 configs on the Hub leave
    most keys to them (the 4B's ``text_config`` has no head counts), as convert_hf_to_gguf.py's defaults say."""
    from shardtune.model.directory import read_config

    return read_config(model_dir).get_text_config().to_dict()


def text_name(name: str) -> str | None:
    """A multimodal checkpoint's tensor under its text model's name; None for the vision tower and projector."""
    for prefix in _TEXT_PREFIXES:
        if name.startswith(prefix):
            return "model." + name[len(prefix):]
    if name == "language_model.lm_head.weight":
        return "lm_head.weight"
    if name.startswith(_VISION_PREFIXES):
        return None
    return name


def llama_cpp_layer_types(n_layers: int) -> list[str]:
    """The sliding/global layers llama.cpp's gemma3 runs when the file has a sliding window."""
    return ["sliding_attention" if i % SWA_PERIOD < SWA_PERIOD - 1 else "full_attention" for i in range(n_layers)]


def problem(config: dict) -> str | None:
    """What in ``config`` llama.cpp's gemma3 would run as another model (see the module docstring), or None."""
    if config.get("use_bidirectional_attention"):
        return "use_bidirectional_attention is true (an encoder, not a causal LM)"
    if config.get("attn_logit_softcapping") is not None:
        return f"attn_logit_softcapping is {config['attn_logit_softcapping']} (Gemma 3 has none)"
    n_layers = config["num_hidden_layers"]
    types = list(config.get("layer_types") or [])
    sliding = "sliding_attention" in types
    if sliding and types != llama_cpp_layer_types(n_layers):
        return f"layer_types {types} are not every {SWA_PERIOD}th layer global and the rest sliding, nor all global"
    if sliding and not config.get("sliding_window"):
        return f"sliding_window is {config.get('sliding_window')!r} but layer_types has sliding layers"
    expected = config["hidden_size"] // config["num_attention_heads"] if n_layers == 62 else config["head_dim"]
    if float(config.get("query_pre_attn_scalar") or 0) != float(expected):
        return f"query_pre_attn_scalar is {config.get('query_pre_attn_scalar')}, llama.cpp scales by 1/sqrt({expected})"
    local = _local_rope(config)
    if sliding and (str(local.get("rope_type", "default")) != "default"
                    or float(local.get("rope_theta", LOCAL_ROPE_BASE)) != LOCAL_ROPE_BASE):
        return (f"the sliding layers' rope is {local} (rope_parameters.sliding_attention; older files: "
                f"rope_local_base_freq), llama.cpp's is the default rope with base {LOCAL_ROPE_BASE:g}")
    return None


def _local_rope(config: dict) -> dict:
    return (config.get("rope_parameters") or {}).get("sliding_attention") or {}


def add_hparams(writer, config: dict) -> None:
    """The keys Gemma 3 adds to the common ones."""
    if "sliding_attention" in (config.get("layer_types") or []):
        writer.add_sliding_window(config["sliding_window"])
    writer.add_rope_freq_base_swa(float(_local_rope(config).get("rope_theta", LOCAL_ROPE_BASE)))
    if config.get("final_logit_softcapping"):
        writer.add_final_logit_softcapping(float(config["final_logit_softcapping"]))
