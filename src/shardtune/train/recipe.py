"""The fine-tuning recipe, run by every rank: set up → load → train → save. Read top to bottom.

Started by the launcher (``python -m shardtune.train CONFIG.yaml``) or by torchrun with the same
arguments. The loss rule, used everywhere: a global batch's loss is the sum of the cross-entropy of
all its target tokens divided by their number, however the batch is split over ranks and
micro-batches. Each micro-batch therefore contributes sum(token losses) / global_target_count.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from shardtune.config import Config, build_config, validate
from shardtune.model.directory import check_model_dir
from shardtune.parallel import Strategy
from shardtune.parallel.sharded_model import Built, build_model
from shardtune.runtime import distributed
from shardtune.runtime.distributed import Worker
from shardtune.runtime.logs import setup_logging
from shardtune.runtime.memory import MemoryMonitor, tune_malloc
from shardtune.train.adapter import save_adapter
from shardtune.train.checkpoint import Checkpointer, TrainState
from shardtune.train.data import BatchPlan, Dataset, Sampler, collate, load_dataset, pad_id, token_cache
from shardtune.train.loss import next_token_loss_sum
from shardtune.train.metrics import MetricsLog, Progress, write_json_atomic
from shardtune.train.stop import GracefulStop, stop_message
from shardtune.train.trackers import Trackers

log = logging.getLogger("shardtune")


@dataclass
class Job:
    """Everything the training loop needs, built once."""

    cfg: Config
    worker: Worker
    built: Built
    train: Dataset
    val: Dataset | None
    sampler: Sampler
    steps: int
    pad_id: int

    @property
    def model(self) -> nn.Module:
        return self.built.model

    @property
    def strategy(self) -> Strategy:
        return self.built.strategy


def total_steps(cfg: Config, n_records: int) -> int:
    if cfg.train.steps:
        return cfg.train.steps
    return max(1, math.ceil((cfg.train.epochs or 1.0) * n_records / cfg.train.batch_size))


def lr_factor(step: int, steps: int, warmup: int, min_ratio: float) -> float:
    """Linear warmup to the peak, then cosine down to ``min_ratio`` × peak at the last step."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup - 1)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def train_step(job: Job, step: int) -> tuple[float, int]:
    """Forward/backward of this rank's micro-batches of global batch ``step``; returns (loss, tokens)."""
    batch = job.sampler.global_batch(step)
    global_targets = sum(job.train.examples[i].targets for i in batch)
    tokens = sum(len(job.train.examples[i].input_ids) for i in batch)
    local_sum = 0.0
    for micro in job.sampler.micro_batches(step, job.worker.rank):
        inputs = collate([job.train.examples[i] for i in micro], job.pad_id, job.worker.device)
        logits = job.model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits
        loss_sum = next_token_loss_sum(logits, inputs["labels"])
        # The loss keeps the logits for its own backward only; a name holding them here would keep
        # them through the whole backward and the next micro-batch's forward.
        del logits
        # Gradient sync averages over ranks; multiplying by world_size turns that average back into
        # the sum over ranks, so the gradient is d(global mean loss) whatever the split.
        (loss_sum * (job.worker.world_size / global_targets)).backward()
        local_sum += loss_sum.item()
    return distributed.all_reduce_sum(local_sum, job.worker.device) / global_targets, tokens


@torch.no_grad()
def evaluate(job: Job) -> float:
    """Mean loss over every target token of the validation data."""
    assert job.val is not None
    job.model.eval()
    examples = job.val.examples
    micro = job.sampler.plan.micro_batch_size
    per_rank = math.ceil(len(examples) / job.worker.world_size)
    mine = examples[job.worker.rank * per_rank:(job.worker.rank + 1) * per_rank]
    loss_sum, count = 0.0, 0
    # Sharded models need every rank in every forward: ranks with fewer records run padding batches.
    for start in range(0, per_rank, micro):
        chunk = mine[start:start + micro] or examples[:1]
        inputs = collate(chunk, job.pad_id, job.worker.device)
        logits = job.model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits
        if mine[start:start + micro]:
            loss_sum += next_token_loss_sum(logits, inputs["labels"]).item()
            count += sum(e.targets for e in chunk)
    job.model.train()
    device = job.worker.device
    return distributed.all_reduce_sum(loss_sum, device) / distributed.all_reduce_sum(count, device)


def prepare(cfg: Config, worker: Worker, memory: MemoryMonitor) -> Job:
    from transformers import AutoTokenizer

    model_dir = check_model_dir(cfg.model.path, cfg.model.trust_remote_code)
    tokenizer = AutoTokenizer.from_pretrained(model_dir.path, trust_remote_code=model_dir.trust_remote_code)
    cache = token_cache(cfg)  # written by preflight: each rank maps it instead of tokenizing again
    train_data = load_dataset(cfg.data.train, tokenizer, cfg.data.seq_len, cfg.data.fields, cache)
    val_data = load_dataset(cfg.data.val, tokenizer, cfg.data.seq_len, cfg.data.fields, cache) if cfg.data.val else None
    if train_data.truncated:
        log.warning("%d of %d training records were cut to --seq-len %d", train_data.truncated,
                    len(train_data.examples) + train_data.without_targets, cfg.data.seq_len)
    if train_data.without_targets:
        log.warning("%d training records have no target token within --seq-len and are skipped",
                    train_data.without_targets)
    plan = BatchPlan.make(cfg.train.batch_size, cfg.train.micro_batch_size, worker.world_size)

    with memory.phase("load"):
        built = build_model(cfg, worker)
    built.model.train()
    torch.manual_seed(cfg.train.seed + worker.rank)  # LoRA dropout differs per rank, reproducibly
    return Job(cfg, worker, built, train_data, val_data, Sampler(len(train_data.examples), plan, cfg.train.seed),
                 total_steps(cfg, len(train_data.examples)), pad_id(tokenizer))


def train(job: Job, memory: MemoryMonitor, out: Path) -> dict:
    cfg = job.cfg
    params = list(job.strategy.trainable(job.model).values())
    optimizer = torch.optim.AdamW(params, lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)
    warmup = cfg.train.warmup_steps if cfg.train.warmup_steps is not None else min(100, job.steps // 10)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, job.steps, warmup, cfg.train.min_lr_ratio))
    checkpoints = Checkpointer(cfg, job.model, job.strategy, job.built.adapter_keys, optimizer, scheduler)
    # Batch ``step`` depends only on (seed, step): starting the loop at the saved step is the data position.
    state = checkpoints.resume() if cfg.output.resume else TrainState()
    first_step = state.step
    metrics = MetricsLog(out / "metrics.jsonl", job.worker.is_main, resume_from_step=state.step)
    trackers = Trackers(cfg.output.report_to, cfg.flat(), out, job.worker.is_main, resume_from_step=state.step)
    try:
        result = _loop(job, memory, optimizer, scheduler, checkpoints, state, metrics, trackers)
    except BaseException:
        trackers.finish(None, failed=True)
        raise
    return {**result, "first_step": first_step, "trackers": trackers}


def _loop(job: Job, memory: MemoryMonitor, optimizer, scheduler, checkpoints: Checkpointer, state: TrainState,
          metrics: MetricsLog, trackers: Trackers) -> dict:
    cfg = job.cfg
    progress = Progress(job.steps, state.step, job.worker.is_main)
    losses, stopped_by = [], 0
    with memory.phase("train"), GracefulStop(job.worker.device) as stop:
        for step in range(state.step, job.steps):
            started = time.perf_counter()
            loss, tokens = train_step(job, step)
            grad_norm = job.strategy.clip_grad_norm(job.model, cfg.train.max_grad_norm)
            lr = scheduler.get_last_lr()[0]
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            seconds = time.perf_counter() - started
            losses.append(loss)
            state.add(loss, tokens, seconds)
            record = {"step": step + 1, "loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens": tokens,
                      "tokens_per_second": tokens / seconds, "seconds": seconds, "memory_mb": memory.now_mb()}
            if job.val and ((cfg.train.eval_every and (step + 1) % cfg.train.eval_every == 0) or step + 1 == job.steps):
                state.val_loss = record["val_loss"] = evaluate(job)
                progress.write(f"step {step + 1}: val_loss {state.val_loss:.4f}")
            metrics.write(record)
            trackers.log(record)
            progress.update(record)
            stopped_by = stop.agreed()  # SIGTERM/SIGINT on any rank: all save, then all stop
            if stopped_by or checkpoints.due(state.step):
                checkpoints.save(state)
            if stopped_by:
                break
    progress.close()
    return {"losses": losses, "state": state, "stopped_by": stopped_by}


def run(cfg: Config) -> dict:
    started = time.perf_counter()
    tune_malloc()  # before anything large is allocated: see memory.py
    worker = distributed.init_worker()
    out = Path(cfg.output.out)
    setup_logging(worker.rank, cfg.output.log_file)
    memory = MemoryMonitor(worker.device)
    try:
        load_started = time.perf_counter()
        job = prepare(cfg, worker, memory)
        load_seconds = time.perf_counter() - load_started
        result = train(job, memory, out)
        state: TrainState = result["state"]
        if result["stopped_by"]:
            result["trackers"].finish(None)  # the run goes on after --resume
            if worker.is_main:
                log.warning("%s", stop_message(result["stopped_by"], out))
            raise SystemExit(128 + result["stopped_by"])
        with memory.phase("save"):
            adapter = save_adapter(job.model, job.strategy, job.built.adapter_keys, out / "adapter", cfg.model.path)
        peaks = distributed.all_gather_object({k: memory.peak_mb(k) for k in ("load", "train", "save")})
        summary = {
            "world_size": worker.world_size, "strategy": job.strategy.name,
            "strategy_reason": job.built.strategy_reason,
            "steps": job.steps, "tokens": state.tokens,
            "train_loss_first": state.first_loss, "train_loss_last": state.last_loss,
            "val_loss": state.val_loss,
            "tokens_per_second": state.tokens / state.train_seconds if state.train_seconds else None,
            "load_seconds": round(load_seconds, 3),
            "load_peak_mb": [p["load"] for p in peaks], "train_peak_mb": [p["train"] for p in peaks],
            "save_peak_mb": [p["save"] for p in peaks],
            "resumed_from_step": result["first_step"] if cfg.output.resume else None,
            "total_params": job.built.total_params, "trainable_params": job.built.trainable_params,
            "truncated_records": job.train.truncated,
            "adapter": str(adapter.resolve()),
            "wall_seconds": round(time.perf_counter() - started, 3),
        }
        if worker.is_main:
            write_json_atomic(out / "summary.json", summary)
        result["trackers"].finish(summary)
        return summary
    finally:
        memory.close()
        distributed.teardown()


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        sys.exit("usage: python -m shardtune.train CONFIG.yaml  (normally started by `shardtune finetune`)")
    cfg = build_config(argv[0])
    validate(cfg)
    run(cfg)


if __name__ == "__main__":
    distributed.worker_main(main)
