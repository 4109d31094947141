"""Checks run once, in the launching process, before any worker starts.

Bad input must stop the run in seconds with one clear message, not after N processes have loaded
a model; these checks read only config, headers, tokenizer and data, and build the model on meta.
The run plan is resolved here too (train/resolve.py), once, for every rank.
"""

from __future__ import annotations

import logging
from pathlib import Path

from shardtune.config import Config, reward_weights, validate
from shardtune.model.adapter_dir import check_adapter_dir
from shardtune.model.attention import check_context_parallel
from shardtune.model.checkpoint_keys import check_against_headers
from shardtune.model.directory import check_model_dir, load_tokenizer
from shardtune.model.lora import inject_lora
from shardtune.model.meta import (
    build_meta_model,
    check_positions,
    check_tokenizer_fits,
    compute_dtype,
    context_warning,
    vocab_size,
)
from shardtune.runplan import RunPlan
from shardtune.runtime.device import check_local_ranks, decide_dtype, device_type, warn_oversubscribed
from shardtune.runtime.files import OutputError, check_writable
from shardtune.runtime.versions import check_apis
from shardtune.runtime.workers import prestart
from shardtune.train.data.checks import pair_warnings, prompt_warnings, warn_about_data
from shardtune.train.data.pack import check_packing
from shardtune.train.data.pairs import PAIRS, split_pair
from shardtune.train.data.prompts import PROMPTS
from shardtune.train.data.read import read_records
from shardtune.train.data.records import DataError, lengths_of
from shardtune.train.input_paths import check_input_paths
from shardtune.train.objectives import objective_of
from shardtune.train.remote_generation import check_server
from shardtune.train.resolve import resolve
from shardtune.train.resume_checks import resume_point
from shardtune.train.rewards import load_rewards
from shardtune.train.run_folder import check_not_finished, check_run_folder
from shardtune.train.schedule import total_steps
from shardtune.train.trackers import check_installed
from shardtune.train.training_data import read_split

log = logging.getLogger("shardtune")


def preflight(cfg: Config) -> tuple[Config, RunPlan]:
    """Check everything that can be checked before the workers start; return ``cfg`` with its auto
    options decided and the run plan every worker runs (train/resolve.py)."""
    from shardtune.runtime.logs import quiet_libraries

    quiet_libraries(imports=False)
    validate(cfg)
    # Before any worker starts: a missing GPU, or more ranks than GPUs, is a config error, not an NCCL hang.
    check_local_ranks(device_type(cfg.parallel.device), cfg.parallel.nproc)
    check_input_paths(cfg)  # every path option, before anything opens one
    warn_oversubscribed(device_type(cfg.parallel.device), cfg.parallel.nproc)
    cfg = decide_dtype(cfg)  # --dtype auto: for this machine's device, the same for every rank
    check_installed(cfg.output.report_to)
    out = Path(cfg.output.out)
    if out.exists() and not out.is_dir():
        raise OutputError(f"option 'out': {out} is an existing file, not a directory")
    check_writable(out)
    check_run_folder(cfg)  # nothing finished in --out is replaced unless asked for
    model_dir = check_model_dir(cfg.model.path, cfg.model.trust_remote_code)
    if cfg.output.resume:  # against the options, the data and the base model; before --out is touched
        resume_point(cfg, model_dir)
    if cfg.lora.init_adapter:  # the one adapter check, and that it was made from this base (model/adapter_dir.py)
        check_adapter_dir(cfg.lora.init_adapter, "option 'init-adapter': adapter directory", base=model_dir)
    # Accepted so far: the workers' starter imports the libraries from now on, alongside the checks below
    # (the libraries' import here among them: before it, nothing of torch's beyond the device was needed).
    prestart(cfg.parallel)
    quiet_libraries()
    check_apis()  # a too-old torch/transformers fails here, by name, not later on a silent fallback
    if cfg.train.objective == "grpo":  # every --reward imported now (after the libraries: a reward module that
        # imports them is as quiet as ours): a missing file or name stops here, named
        load_rewards(cfg.grpo.reward or [], reward_weights(cfg.grpo.reward_weights))
        if cfg.grpo.vllm_url:  # the generator answers and takes adapters, before any model loads
            check_server(cfg.grpo.vllm_url)
    tokenizer = load_tokenizer(model_dir)
    completion = cfg.completion_room()
    longest = cfg.data.seq_len + completion  # a row: its --seq-len part and GRPO's completion
    made_by = f"--seq-len {cfg.data.seq_len}" + (f" + --max-completion-length {completion}" if completion else "")
    vocab = vocab_size(model_dir)
    check_tokenizer_fits(tokenizer, vocab, model_dir)
    # Tokenized once, here: the workers map the cache instead of each tokenizing every record again.
    objective = objective_of(cfg)
    fmt = objective.records
    train = read_split(cfg, cfg.data.train, tokenizer, vocab, show_progress=True)
    records = read_records(cfg.data.train, cfg.data.fields, fmt.check)
    warn_about_data(cfg.data.train, records, len(train.examples) // fmt.per_record,
                    objective.records_per_batch(cfg.train.batch_size),
                    tokenizer, cfg.model.path)
    if fmt is PROMPTS:
        for message in prompt_warnings(cfg.data.train, records):
            log.warning("%s", message)
    if fmt is PAIRS:
        refuse_identical_pairs(cfg.data.train, records)
        for message in pair_warnings(cfg.data.train, records, train.truncated, cfg.data.seq_len):
            log.warning("%s", message)
    check_not_finished(cfg, total_steps(cfg, objective.epoch_items(len(train.examples))))
    if cfg.data.val:
        read_split(cfg, cfg.data.val, tokenizer, vocab, show_progress=True)
    model, _ = inject_lora(build_meta_model(model_dir, compute_dtype(cfg)), cfg.lora, cfg.train.seed)
    check_against_headers(model, model_dir)  # every weight there, of its shape and a float dtype
    check_positions(model, longest, made_by, model_dir.path)  # a learned table: refused; rotary: said
    if (warning := context_warning(model_dir, longest, made_by)) is not None:
        log.warning("%s", warning)
    if cfg.data.packing:
        check_packing(model)
    cfg, plan, _ = resolve(cfg, lengths_of(train.examples), model)
    assert plan is not None  # the device was checked above: a run always has one
    check_context_parallel(model, plan.context_parallel)
    if plan.why:
        log.info("configuration: %s", plan.why)
    return cfg, plan


def refuse_identical_pairs(path: str, records: list[tuple[int, dict]]) -> None:
    """Preference data whose every pair has the same chosen and rejected response: the preference loss
    has nothing to compare, the adapter cannot move, so the run would only spend its time. (Some such
    pairs are a warning, pairs.pair_warnings.)"""
    if records and all(split_pair(r)[1] == split_pair(r)[2] for _, r in records):
        raise DataError(f"{path}: in all {len(records)} pairs the chosen and the rejected response are the same: a "
                        "preference objective learns nothing from them. Check the file (or --data-fields: are "
                        "chosen and rejected mapped onto the same column?)")
