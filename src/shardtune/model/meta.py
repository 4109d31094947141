"""The model built on the meta device from its config: no base weight is allocated here.

Parameters live on the meta device; buffers (rotary ``inv_freq`` and the like) are real, because
they are computed from the config and never stored in the checkpoint.
"""

from __future__ import annotations

import torch
from torch import nn

from shardtune.config import Config, ConfigError
from shardtune.model.directory import ModelDir, ModelDirError, read_config
from shardtune.runtime.device import decide_dtype

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def compute_dtype(cfg: Config) -> torch.dtype:
    """The run's frozen-weight and compute dtype (``--dtype``, auto decided for the run's device)."""
    return DTYPES[decide_dtype(cfg).model.dtype]


def check_tokenizer_fits(tokenizer, vocab: int | None, model_dir: ModelDir) -> None:
    """A tokenizer with more tokens than the model has embedding rows: some ids would index past it."""
    if vocab is not None and len(tokenizer) > vocab:
        raise ModelDirError(f"{model_dir.path}: the tokenizer has {len(tokenizer)} tokens but config.json's "
                            f"vocab_size is {vocab} (embedding rows): the tokenizer does not belong to this model")


def build_meta_model(model_dir: ModelDir, dtype: torch.dtype) -> nn.Module:
    """The causal LM from its config, weights on meta, tied weights tied as transformers ties them."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    config = read_config(model_dir)
    try:
        with init_empty_weights(include_buffers=False):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype,
                                                     trust_remote_code=model_dir.trust_remote_code)
    except (ValueError, TypeError, AttributeError, ZeroDivisionError, RuntimeError) as err:
        raise ModelDirError(
            f"{model_dir.path / 'config.json'}: not a causal LM transformers can build ({err})"
        ) from None
    # accelerate re-creates every parameter registered under init_empty_weights, which undoes the
    # tying done in __init__: tie again now that registration is plain.
    model.tie_weights()
    model.config.use_cache = False
    return model




def context_warning(model_dir: ModelDir, tokens: int, what: str) -> str | None:
    """A warning when sequences of ``tokens`` (``what`` makes them, e.g. ``--seq-len 4096``) exceed the positions
    the model was trained for (``max_position_embeddings``) and its config scales no rotary embedding to reach
    them: users extend a context on purpose, so not an error (unless the positions are a learned table, which
    has no row beyond them: ``check_positions``)."""
    config = read_config(model_dir).get_text_config()
    positions = getattr(config, "max_position_embeddings", None)
    scaling = getattr(config, "rope_scaling", None) or {}
    scaled = isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type", "default")) != "default"
    if not positions or tokens <= positions or scaled:
        return None
    return (f"{what} exceeds the {positions} positions {model_dir.path / 'config.json'} was trained for "
            "(max_position_embeddings) and it sets no rope scaling: positions beyond it are extrapolated; set "
            "rope_scaling in the config (e.g. yarn) if you mean to extend the context")


def learned_positions(model: nn.Module) -> int | None:
    """How many positions ``model``'s learned position table holds (GPT-2's ``wpe``, OPT's ``embed_positions``,
    which keeps 2 rows more): None for a model without one (rotary, ALiBi), whose positions go on."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    positions = getattr(text, "max_position_embeddings", None)
    if not isinstance(positions, int):
        return None
    words = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    for module in model.modules():
        if isinstance(module, nn.Embedding) and module is not words and \
                module.num_embeddings in (positions, positions + 2):
            return positions
    return None


def check_positions(model: nn.Module, tokens: int, what: str, where: object) -> None:
    """Sequences of ``tokens`` (``what`` makes them) on a model (of ``where``) whose learned position table holds
    fewer: ConfigError naming both, before any forward would index past the table deep inside torch."""
    limit = learned_positions(model)
    if limit is not None and tokens > limit:
        raise ConfigError(f"{what} makes sequences of up to {tokens} tokens, but the model of {where} has learned "
                          f"positions for {limit} tokens (max_position_embeddings) and none beyond: keep "
                          f"sequences to {limit} tokens at most")


def vocab_size(model_dir: ModelDir) -> int | None:
    """Rows of the input embedding by the config: the bound every token id of the data must respect."""
    value = getattr(read_config(model_dir).get_text_config(), "vocab_size", None)
    return int(value) if value else None
