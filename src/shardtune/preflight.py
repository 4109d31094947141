"""Checks run once, in the launching process, before any worker starts.

Bad input must stop the run in seconds with one clear message, not after N processes have loaded
a model; these checks read only config, headers, tokenizer and data, and build the model on meta.
The ``auto`` options are decided here too (choice.py), once, for every rank.
"""

from __future__ import annotations

import logging
from pathlib import Path

from shardtune.choice import choose
from shardtune.config import Config, validate
from shardtune.model import quantize
from shardtune.model.directory import check_model_dir, load_tokenizer
from shardtune.model.loading import check_against_headers
from shardtune.model.lora import inject_lora
from shardtune.model.meta import build_meta_model, check_tokenizer_fits, compute_dtype, vocab_size
from shardtune.runtime.device import check_local_ranks, decide_dtype, device_type, warn_oversubscribed
from shardtune.runtime.files import OutputError, check_writable
from shardtune.runtime.versions import check_apis
from shardtune.train.checkpoint import resume_point
from shardtune.train.data import BatchPlan, load_dataset, mean_tokens, read_records, token_cache
from shardtune.train.data_checks import warn_about_data
from shardtune.train.input_paths import check_input_paths
from shardtune.train.packing import check_packing, packed_plan
from shardtune.train.run_folder import check_run_folder
from shardtune.train.trackers import check_installed

log = logging.getLogger("shardtune")


def preflight(cfg: Config) -> Config:
    """Check everything that can be checked before the workers start; return ``cfg`` with its auto
    options decided (choice.py), which is what every worker must run with."""
    from shardtune.runtime.logs import quiet_libraries

    quiet_libraries()
    check_apis()  # a too-old torch/transformers fails here, by name, not later on a silent fallback
    validate(cfg)
    check_input_paths(cfg)  # every path option, before anything opens one
    # Before any worker starts: a missing GPU, or more ranks than GPUs, is a config error, not an NCCL hang.
    check_local_ranks(device_type(cfg.parallel.device), cfg.parallel.nproc)
    warn_oversubscribed(device_type(cfg.parallel.device), cfg.parallel.nproc)
    cfg = decide_dtype(cfg)  # --dtype auto: for this machine's device, the same for every rank
    check_installed(cfg.output.report_to)
    out = Path(cfg.output.out)
    if out.exists() and not out.is_dir():
        raise OutputError(f"option 'out': {out} is an existing file, not a directory")
    check_writable(out)
    check_run_folder(cfg)  # nothing finished in --out is replaced unless asked for
    if cfg.output.resume:
        resume_point(cfg)  # a refused resume must not get as far as touching --out
    model_dir = check_model_dir(cfg.model.path, cfg.model.trust_remote_code)
    tokenizer = load_tokenizer(model_dir)
    vocab = vocab_size(model_dir)
    check_tokenizer_fits(tokenizer, vocab, model_dir)
    # Tokenized once, here: the workers map the cache instead of each tokenizing every record again.
    cache = token_cache(cfg)
    train = load_dataset(cfg.data.train, tokenizer, cfg.data.seq_len, vocab, cfg.data.fields, cache)
    warn_about_data(cfg.data.train, read_records(cfg.data.train, cfg.data.fields), len(train.examples),
                    cfg.train.batch_size)
    if cfg.data.val:
        load_dataset(cfg.data.val, tokenizer, cfg.data.seq_len, vocab, cfg.data.fields, cache)
    if cfg.model.quantize == "nf4":
        quantize.check_available()
    model, _ = inject_lora(build_meta_model(model_dir, compute_dtype(cfg)), cfg.lora, cfg.train.seed)
    check_against_headers(model, model_dir)  # every weight there, of its shape and a float dtype
    if cfg.data.packing:
        check_packing(model)
    ranks = cfg.parallel.nproc * cfg.parallel.nnodes
    if cfg.train.micro_batch_size != "auto":  # checked before the choice: its error names the user's value
        _batch_plan(cfg, ranks)
    cfg, _, why = choose(cfg, mean_tokens(train.examples))
    if why:
        log.info("configuration: %s", why)
    if cfg.model.quantize == "nf4" and cfg.parallel.strategy == "fsdp2":
        quantize.check_even_split(quantize.select(model), ranks // cfg.parallel.replicate_groups)
    _batch_plan(cfg, ranks)
    return cfg


def _batch_plan(cfg: Config, ranks: int) -> None:
    if cfg.data.packing:
        packed_plan(cfg.train.batch_size, cfg.train.micro_batch_size, ranks)
    else:
        BatchPlan.make(cfg.train.batch_size, cfg.train.micro_batch_size, ranks)
