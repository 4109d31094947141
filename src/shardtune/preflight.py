"""Checks run once, in the launching process, before any worker starts.

Bad input must stop the run in seconds with one clear message, not after N processes have loaded
a model; these checks read only config, headers, tokenizer and data, and build the model on meta.
"""

from __future__ import annotations

from shardtune.config import Config, validate
from shardtune.model.directory import ModelDirError, check_model_dir
from shardtune.model.lora import inject_lora
from shardtune.model.meta import DTYPES, build_meta_model
from shardtune.train.data import BatchPlan, load_dataset, token_cache
from shardtune.train.trackers import check_installed


def preflight(cfg: Config) -> None:
    from transformers import AutoTokenizer

    from shardtune.runtime.logs import quiet_libraries

    quiet_libraries()
    validate(cfg)
    check_installed(cfg.output.report_to)
    model_dir = check_model_dir(cfg.model.path, cfg.model.trust_remote_code)
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir.path, trust_remote_code=model_dir.trust_remote_code)
    except (OSError, ValueError) as err:
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0].rstrip(" :")
        raise ModelDirError(
            f"model directory {model_dir.path} has no usable tokenizer "
            f"(tokenizer.json, tokenizer_config.json): {reason}"
        ) from None
    load_dataset(cfg.data.train, tokenizer, cfg.data.seq_len, cfg.data.fields, token_cache(cfg))
    if cfg.data.val:
        load_dataset(cfg.data.val, tokenizer, cfg.data.seq_len, cfg.data.fields, token_cache(cfg))
    BatchPlan.make(cfg.train.batch_size, cfg.train.micro_batch_size, cfg.parallel.nproc * cfg.parallel.nnodes)
    inject_lora(build_meta_model(model_dir, DTYPES[cfg.model.dtype]), cfg.lora, cfg.train.seed)
