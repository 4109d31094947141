"""Checks run once, in the launching process, before any worker starts.

Bad input must stop the run in seconds with one clear message, not after N processes have loaded
a model; these checks read only config, headers, tokenizer and data, and build the model on meta.
"""

from __future__ import annotations

import logging

from shardtune.choice import choose
from shardtune.config import Config, validate
from shardtune.model.directory import ModelDirError, check_model_dir
from shardtune.model.lora import inject_lora
from shardtune.model.meta import DTYPES, build_meta_model, vocab_size
from shardtune.train.data import BatchPlan, load_dataset
from shardtune.train.packing import check_packing, packed_plan

log = logging.getLogger("shardtune")


def preflight(cfg: Config) -> Config:
    """Check everything that can be checked before the workers start; return ``cfg`` with its auto
    options decided (choice.py), which is what every worker must run with."""
    from transformers import AutoTokenizer

    from shardtune.runtime.logs import quiet_libraries

    quiet_libraries()
    validate(cfg)
    model_dir = check_model_dir(cfg.model.path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir.path)
    except (OSError, ValueError) as err:
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0].rstrip(" :")
        raise ModelDirError(
            f"model directory {model_dir.path} has no usable tokenizer "
            f"(tokenizer.json, tokenizer_config.json): {reason}"
        ) from None
    vocab = vocab_size(model_dir)
    load_dataset(cfg.data.train, tokenizer, cfg.data.seq_len, vocab)
    if cfg.data.val:
        load_dataset(cfg.data.val, tokenizer, cfg.data.seq_len, vocab)
    model, _ = inject_lora(build_meta_model(model_dir, DTYPES[cfg.model.dtype]), cfg.lora, cfg.train.seed)
    if cfg.data.packing:
        check_packing(model)
    ranks = cfg.parallel.nproc * cfg.parallel.nnodes
    if cfg.train.micro_batch_size != "auto":  # checked before the choice: its error names the user's value
        _batch_plan(cfg, ranks)
    cfg, _, why = choose(cfg)
    if why:
        log.info("configuration: %s", why)
    _batch_plan(cfg, ranks)
    return cfg


def _batch_plan(cfg: Config, ranks: int) -> None:
    if cfg.data.packing:
        packed_plan(cfg.train.batch_size, cfg.train.micro_batch_size, ranks)
    else:
        BatchPlan.make(cfg.train.batch_size, cfg.train.micro_batch_size, ranks)
