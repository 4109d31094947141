"""The fine-tuning recipe, run by every rank: set up → load → train → save. Read top to bottom.

Started by the launcher (``python -m shardtune.train CONFIG.yaml``) or by torchrun with the same
arguments. The loss rule, used everywhere: a global batch's loss is the sum of the cross-entropy of
all its target tokens divided by their number, however the batch is split over ranks and
micro-batches. Each micro-batch therefore contributes sum(token losses) / global_target_count.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from shardtune.config import Config, build_config, validate
from shardtune.errors import ShardtuneError
from shardtune.model.directory import ModelDir, check_model_dir
from shardtune.model.meta import compute_dtype, vocab_size
from shardtune.parallel import Strategy
from shardtune.parallel.sharded_model import Built, build_model
from shardtune.runplan import RunPlan
from shardtune.runtime import distributed
from shardtune.runtime.cpu_tuning import tune_malloc
from shardtune.runtime.device import device_type
from shardtune.runtime.distributed import Worker
from shardtune.runtime.failure import stage
from shardtune.runtime.logs import EVERY_RANK, setup_logging
from shardtune.runtime.memory import MemoryMonitor
from shardtune.runtime.worker_failures import Stopped
from shardtune.train import preference, validation
from shardtune.train.adapter import save_adapter
from shardtune.train.checkpoint import Checkpointer, TrainState
from shardtune.train.data import Dataset, Sampler, collate, pad_id, token_cache
from shardtune.train.datasets_io import cache_key
from shardtune.train.guard import TrainingGuard
from shardtune.train.loss import next_token_loss_sum
from shardtune.train.metrics import MetricsLog, Progress, write_json_atomic
from shardtune.train.objectives import METRICS, Objective, objective_of
from shardtune.train.packing import VARLEN, attention_of, check_packing, packed_forwards
from shardtune.train.pairs import PAIRS
from shardtune.train.reference import compute_reference, precomputed_reference, reference_key
from shardtune.train.resolve import resolve, resolve_on
from shardtune.train.scaling import ShardedGradScaler, make_scaler
from shardtune.train.stop import GracefulStop, stop_message
from shardtune.train.trackers import Trackers
from shardtune.train.training_data import read_split, record_format, training_lengths

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
    scaler: ShardedGradScaler  # fp16's loss scaling; passes everything through otherwise
    objective: Objective
    model_dir: ModelDir
    reference: torch.Tensor | None = None  # (pairs, 2): precomputed reference log-probs of the training pairs
    val_reference: torch.Tensor | None = None  # the same for the validation pairs

    @property
    def model(self) -> nn.Module:
        return self.built.model

    @property
    def strategy(self) -> Strategy:
        return self.built.strategy


def total_steps(cfg: Config, n_records: int) -> int:
    """``n_records``: records, or pairs under a preference objective (what --batch-size counts)."""
    if cfg.train.steps:
        return cfg.train.steps
    return max(1, math.ceil((cfg.train.epochs or 1.0) * n_records / cfg.train.batch_size))


def lr_factor(step: int, steps: int, warmup: int, min_ratio: float) -> float:
    """Linear warmup to the peak, then cosine down to ``min_ratio`` × peak at the last step."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup - 1)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


@dataclass
class Forward:
    """One forward pass of a rank: the model's inputs, the labels, and how full it is."""

    inputs: dict[str, torch.Tensor]
    labels: torch.Tensor
    real_tokens: int  # record tokens, not padding
    positions: int  # tokens the model computes, padding included


def forwards(job: Job, step: int) -> list[Forward]:
    """This rank's forward passes of global batch ``step``: packed rows, or padded micro-batches."""
    examples, device = job.train.examples, job.worker.device
    if job.cfg.data.packing:
        attention = attention_of(job.model)
        packed = packed_forwards(job.sampler.global_batch(step), examples, job.sampler.plan, job.cfg.data.seq_len,
                                 job.worker.rank, job.pad_id, device, one_row=attention in VARLEN)
        dtype = compute_dtype(job.cfg)
        return [Forward(p.model_inputs(attention, dtype), p.labels, p.real_tokens, p.positions) for p in packed]
    out = []
    for micro in job.sampler.micro_batches(step, job.worker.rank):
        chunk = [examples[i] for i in micro]
        inputs = collate(chunk, job.pad_id, device)
        out.append(Forward({"input_ids": inputs["input_ids"], "attention_mask": inputs["attention_mask"]},
                           inputs["labels"], sum(len(e.input_ids) for e in chunk), inputs["input_ids"].numel()))
    return out


@dataclass
class StepResult:
    loss: float
    tokens: int  # real tokens of the global batch
    fill: float  # the share of all ranks' computed positions that are real tokens
    metrics: dict[str, float]  # the objective's own (preference: TRL's rewards/… and logps/…)


def train_step(job: Job, step: int) -> StepResult:
    """Forward/backward of this rank's share of global batch ``step``.

    Nothing here waits for the device until the step's end: the loss sum stays a device tensor, and
    gradients are reduced over ranks once, in the last forward's backward.
    """
    if job.objective.pairs:
        return pair_step(job, step)
    batch = job.sampler.global_batch(step)
    global_targets = sum(job.train.examples[i].targets for i in batch)
    tokens = sum(len(job.train.examples[i].input_ids) for i in batch)
    local_sum = torch.zeros((), dtype=torch.float32, device=job.worker.device)
    passes = forwards(job, step)
    for n, fwd in enumerate(passes):
        with job.strategy.gradient_sync(job.model, enabled=n == len(passes) - 1):
            logits = job.model(**fwd.inputs).logits
            loss_sum = next_token_loss_sum(logits, fwd.labels)
            # The loss keeps the logits for its own backward only; a name holding them here would keep
            # them through the whole backward and the next forward.
            del logits
            # Gradient sync averages over ranks; multiplying by world_size turns that average back into
            # the sum over ranks, so the gradient is d(global mean loss) whatever the split.
            job.scaler.scale(loss_sum * (job.worker.world_size / global_targets)).backward()
        local_sum += loss_sum.detach()
    positions = distributed.all_reduce_sum(sum(f.positions for f in passes), job.worker.device)
    loss = distributed.all_reduce_sum(local_sum.item(), job.worker.device) / global_targets
    return StepResult(loss, tokens, tokens / positions, {})


def pair_forwards(job: Job, pairs: list[int], per_forward: list[list[int]]) -> list[preference.PairForward]:
    """This rank's forwards of the global batch ``pairs``: packed, or its micro-batches ``per_forward`` padded."""
    examples, device = job.train.examples, job.worker.device
    if job.cfg.data.packing:
        attention = attention_of(job.model)
        return preference.packed_forwards(pairs, examples, job.sampler.plan.micro_batch_size,
                                          job.worker.world_size, job.cfg.data.seq_len, job.worker.rank, job.pad_id,
                                          device, attention in VARLEN, attention, compute_dtype(job.cfg))
    return [preference.padded_forward(examples, micro, job.pad_id, device) for micro in per_forward]


def pair_step(job: Job, step: int) -> StepResult:
    """``train_step`` for preference pairs: the global loss is the mean over the batch's pairs of each pair's
    loss (ORPO: plus the chosen responses' mean token NLL), so each forward adds its pairs' share of it."""
    examples, device, world = job.train.examples, job.worker.device, job.worker.world_size
    batch = job.sampler.global_batch(step)
    chosen_targets = sum(examples[2 * p].targets for p in batch)
    tokens = sum(len(e.input_ids) for p in batch for e in preference.pair_examples(examples, p))
    sums = torch.zeros(1 + len(METRICS), dtype=torch.float32, device=device)
    passes = pair_forwards(job, batch, job.sampler.micro_batches(step, job.worker.rank))
    for n, fwd in enumerate(passes):
        counts = preference.target_counts(examples, fwd.pairs, device)
        reference = None
        if job.objective.reference:
            reference = (job.reference[fwd.pairs].to(device) if job.reference is not None
                         else preference.reference_logps(job.model, fwd))
        with job.strategy.gradient_sync(job.model, enabled=n == len(passes) - 1):
            logps = preference.forward_logps(job.model, fwd)
            terms = preference.terms_of(job.objective, logps, counts, reference)
            loss = terms.losses.sum() / len(batch) + terms.nll_sum / chosen_targets
            job.scaler.scale(loss * world).backward()  # × world: gradient sync averages over ranks
        sums += torch.cat([loss.detach().reshape(1), terms.metric_sums()])
    positions = distributed.all_reduce_sum(sum(f.positions for f in passes), device)
    if world > 1:
        torch.distributed.all_reduce(sums)
    values = sums.tolist()
    metrics = {name: v / len(batch) for name, v in zip(METRICS, values[1:])}
    return StepResult(values[0], tokens, tokens / positions, metrics)


def evaluate(job: Job) -> dict[str, float]:
    """The validation figures: ``val_loss`` (SFT: the mean loss over every target token; pairs: the
    objective's loss), and for pairs TRL's metrics as ``val_rewards/…``, ``val_logps/…``."""
    assert job.val is not None
    job.model.eval()
    worker = job.worker
    micro = job.sampler.plan.micro_batch_size
    if job.objective.pairs:
        sums = preference.evaluate_pairs(job.model, job.objective, job.val.examples, micro, job.pad_id,
                                         worker.device, worker.rank, worker.world_size, job.val_reference)
        if worker.world_size > 1:
            torch.distributed.all_reduce(sums)
        job.strategy.after_inference(job.model)
        job.model.train()
        return {f"val_{k}": v for k, v in preference.pair_summary(sums).items()}
    loss_sum, count = validation.loss_sums(job.model, job.val.examples, job.pad_id, worker.device, micro,
                                           worker.rank, worker.world_size, lockstep=True)
    job.strategy.after_inference(job.model)
    job.model.train()
    return {"val_loss": distributed.all_reduce_sum(loss_sum, worker.device)
            / distributed.all_reduce_sum(count, worker.device)}


def prepare(cfg: Config, worker: Worker, memory: MemoryMonitor, plan: RunPlan | None = None) -> Job:
    """The job of ``plan`` (default, for callers that are their own entry point: ``resolve_on(worker, cfg)``)."""
    from transformers import AutoTokenizer

    plan = plan or resolve_on(worker, cfg)
    plan.check(cfg, worker.world_size, worker.device.type)  # the batches too: this rank makes them

    model_dir = check_model_dir(cfg.model.path, cfg.model.trust_remote_code)
    tokenizer = AutoTokenizer.from_pretrained(model_dir.path, trust_remote_code=model_dir.trust_remote_code)
    objective = objective_of(cfg)
    fmt = record_format(cfg)
    # Before any collective: a bad token id stops every rank here, with the record named.
    vocab = vocab_size(model_dir)
    cache = token_cache(cfg)  # written by preflight: each rank maps it instead of tokenizing again
    train_data = read_split(cfg, cfg.data.train, tokenizer, vocab)
    val_data = (read_split(cfg, cfg.data.val, tokenizer, vocab)
                if cfg.data.val else None)
    what = "pairs" if objective.pairs else "records"
    if train_data.truncated and not objective.pairs:  # pairs: preflight warned, with which side is cut
        log.warning("%d of %d training records were cut to --seq-len %d", train_data.truncated,
                    len(train_data.examples) + train_data.without_targets, cfg.data.seq_len, extra=EVERY_RANK)
    if train_data.without_targets:
        log.warning("%d training %s have no target token within --seq-len and are skipped",
                    train_data.without_targets, what, extra=EVERY_RANK)
    # peft (and the transformers modelling code it brings) is code, not loading: imported before the
    # phase starts, it is part of the runtime the planner holds fixed (memory_model.RUNTIME_CPU_MB).
    import peft  # noqa: F401

    with memory.phase("load"):
        built = build_model(cfg, worker, plan)
    if cfg.data.packing:
        check_packing(built.strategy.unwrap(built.model))
    built.model.train()
    n_items = len(train_data.examples) // fmt.per_record
    job = Job(cfg, worker, built, train_data, val_data, Sampler(n_items, plan.batch, cfg.train.seed),
              total_steps(cfg, n_items), pad_id(tokenizer), make_scaler(cfg.model.dtype, worker.device), objective,
              model_dir)
    if objective.reference and (cfg.preference.precompute_reference or cfg.lora.init_adapter):
        job.reference, job.val_reference = reference_tables(job, tokenizer, cache)
    torch.manual_seed(cfg.train.seed + worker.rank)  # LoRA dropout differs per rank, reproducibly
    return job


def reference_tables(job: Job, tokenizer, cache: Path) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The precomputed reference log-probs of the training (and validation) pairs: the base model's, or
    with --init-adapter the initial model's (computed before any step, with the adapter on)."""
    cfg, worker = job.cfg, job.worker
    tables = []
    for path, data in ((cfg.data.train, job.train), (cfg.data.val, job.val)):
        if data is None:
            tables.append(None)
            continue
        data_key = cache_key(path, tokenizer, cfg.data.seq_len, f"{cfg.data.fields}|{PAIRS.name}")
        key = reference_key(data_key, cfg.model.path, cfg.model.dtype, cfg.model.quantize, cfg.lora.init_adapter)

        def compute(data=data):
            return compute_reference(job.model, data.examples, job.sampler.plan.micro_batch_size, job.pad_id,
                                     worker.device, worker.rank, worker.world_size,
                                     adapters_on=cfg.lora.init_adapter is not None)

        tables.append(precomputed_reference(cache, key, compute, worker.is_main, worker.world_size, str(path)))
    job.strategy.after_inference(job.model)
    return tables[0], tables[1]


def train(job: Job, memory: MemoryMonitor, out: Path) -> dict:
    cfg = job.cfg
    params = list(job.strategy.trainable(job.model).values())
    optimizer = torch.optim.AdamW(params, lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)
    warmup = cfg.train.warmup_steps if cfg.train.warmup_steps is not None else min(100, job.steps // 10)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, job.steps, warmup, cfg.train.min_lr_ratio))
    checkpoints = Checkpointer(cfg, job.model, job.strategy, job.built.adapter_keys, optimizer, scheduler,
                               job.model_dir, job.scaler)
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
    out = Path(cfg.output.out)
    progress = Progress(job.steps, state.step, job.worker.is_main)
    losses, fills, stopped_by = [], [], 0
    guard = TrainingGuard(out, cfg.train.lr, job.worker.is_main, cfg.lora.alpha)
    with memory.phase("train"), GracefulStop(job.worker.device) as stop:
        for step in range(state.step, job.steps):
            started = time.perf_counter()
            result = train_step(job, step)
            loss, tokens, fill = result.loss, result.tokens, result.fill
            job.scaler.unscale_(optimizer)  # fp16: clip and step see the true gradients
            grad_norm = job.strategy.clip_grad_norm(job.model, cfg.train.max_grad_norm)
            guard.check(step + 1, loss, grad_norm)  # before the optimizer step: no NaN weight is ever kept
            lr = scheduler.get_last_lr()[0]
            job.scaler.step(optimizer)  # fp16: skipped on every rank when a gradient is inf/NaN on one
            job.scaler.update()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            seconds = time.perf_counter() - started
            losses.append(loss)
            state.add(loss, tokens, seconds)
            fills.append(fill)
            record = {"step": step + 1, "loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens": tokens,
                      "tokens_per_second": tokens / seconds, "fill_ratio": fill, "seconds": seconds,
                      "memory_mb": memory.now_mb(), "peak_mb": memory.peak_so_far_mb(), **result.metrics}
            progress.update(record)  # before validation: the step's rate is the step's own
            if job.val and ((cfg.train.eval_every and (step + 1) % cfg.train.eval_every == 0) or step + 1 == job.steps):
                record.update(evaluate(job))
                state.val_loss = record["val_loss"]
                progress.validated(step + 1, state.val_loss)
            metrics.write(record)
            trackers.log(record)
            stopped_by = stop.agreed()  # SIGTERM/SIGINT on any rank: all save, then all stop
            if stopped_by or checkpoints.due(state.step):
                checkpoints.save(state)
            if stopped_by:
                break
    progress.close()
    return {"losses": losses, "fills": fills, "state": state, "stopped_by": stopped_by}


def run(cfg: Config, plan: RunPlan | None = None) -> dict:
    """Fine-tune as this rank with rank 0's run plan; return the run's summary. Without a ``plan``
    (``python -m shardtune.train CONFIG.yaml`` started by hand) rank 0 resolves it. A stop by
    SIGTERM/SIGINT raises ``Stopped`` once every rank has checkpointed (its ``exit_code`` is 128 + signal)."""
    started = time.perf_counter()
    if device_type(cfg.parallel.device) == "cpu":
        tune_malloc()  # before anything large is allocated: see cpu_tuning.py (CPU memory only)
    worker = distributed.init_worker(cfg.parallel.device, cfg.parallel.cpu_offload, cfg.parallel.collective_timeout)
    cfg, plan = _plan_of_rank0(cfg, plan, worker)
    out = Path(cfg.output.out)
    setup_logging(worker.rank, cfg.output.log_file)
    if worker.is_main and plan.why:
        log.info("configuration: %s", plan.why)
    memory = MemoryMonitor(worker.device)
    try:
        load_started = time.perf_counter()
        with stage("load"):
            job = prepare(cfg, worker, memory, plan)
        load_seconds = time.perf_counter() - load_started
        with stage("train"):
            result = train(job, memory, out)
        state: TrainState = result["state"]
        if result["stopped_by"]:
            result["trackers"].finish(None)  # the run goes on after --resume
            message = stop_message(result["stopped_by"], out, cfg.parallel.nnodes, cfg.parallel.node_rank)
            if worker.is_main:
                log.warning("%s", message)
            raise Stopped(result["stopped_by"], message)
        with memory.phase("save"), stage("save"):
            adapter = save_adapter(job.model, job.strategy, job.built.adapter_keys, out / "adapter", cfg.model.path)
        phases = ("load", "train", "save")
        peaks = distributed.all_gather_object({**{k: memory.peak_mb(k) for k in phases},
                                               "runtime": round(memory.starts["load"], 1)})
        cuda_peaks = distributed.all_gather_object(memory.cuda_peaks_mb()) if worker.device.type == "cuda" else None
        summary = {
            "world_size": worker.world_size, "strategy": job.strategy.name, "dtype": cfg.model.dtype,
            "device": worker.device.type, "backend": str(torch.distributed.get_backend()),
            "strategy_reason": job.built.strategy_reason,
            "micro_batch_size": job.sampler.plan.micro_batch_size,
            "activation_checkpointing": cfg.parallel.activation_checkpointing,
            "fsdp_unit": cfg.parallel.fsdp_unit if job.strategy.name == "fsdp2" else None,
            "run_plan": plan.as_dict(),
            "steps": job.steps, "tokens": state.tokens,
            "train_loss_first": state.first_loss, "train_loss_last": state.last_loss,
            "val_loss": state.val_loss,
            "tokens_per_second": state.tokens / state.train_seconds if state.train_seconds else None,
            "load_seconds": round(load_seconds, 3),
            "load_peak_mb": [p["load"] for p in peaks], "train_peak_mb": [p["train"] for p in peaks],
            "save_peak_mb": [p["save"] for p in peaks],
            "runtime_mb": [p["runtime"] for p in peaks],  # in use before loading: the planner's "runtime"
            # GPU: torch's max_memory_allocated and max_memory_reserved per phase and rank; reserved
            # (allocated plus the caching allocator's free blocks) is what runs out first.
            **({f"cuda_max_{kind}_mb": {k: [c[k][kind] for c in cuda_peaks] for k in phases}
                for kind in ("allocated", "reserved")} if cuda_peaks else {}),
            "resumed_from_step": result["first_step"] if cfg.output.resume else None,
            "total_params": job.built.total_params, "trainable_params": job.built.trainable_params,
            "truncated_records": job.train.truncated,
            "packing": cfg.data.packing,
            # real (non-padding) tokens / positions computed, averaged over this process's steps
            "fill_ratio": sum(result["fills"]) / len(result["fills"]) if result["fills"] else None,
            "adapter": str(adapter.resolve()),
            "wall_seconds": round(time.perf_counter() - started, 3),
        }
        if worker.is_main:
            write_json_atomic(out / "summary.json", summary)
        result["trackers"].finish(summary)
        return summary
    finally:
        # The process group is left to the process's exit (workers leave through exit_worker). Destroying it
        # here made DDP's reducer drop the group's last reference when run() returned: the group's destructor
        # then waited, holding the GIL, for a gloo thread that needed the GIL (a finished worker hung in CI).
        memory.close()


def _plan_of_rank0(cfg: Config, plan: RunPlan | None, worker: Worker) -> tuple[Config, RunPlan]:
    """Rank 0's (config, plan), on every rank: under plain torchrun each rank resolved its own in
    preflight, and only one may count; without a plan rank 0 resolves it here. A refusal reaches
    every rank, so none waits for a plan that never comes. Rank 0 sizes the step by the training data,
    as preflight does."""
    decided: object = None
    if worker.rank == 0:
        try:
            decided = (cfg, plan) if plan is not None else resolve(cfg, training_lengths(cfg))[:2]
        except ShardtuneError as err:
            decided = err
    if worker.world_size > 1:
        decided = distributed.all_gather_object(decided)[0]
    if isinstance(decided, ShardtuneError):
        raise decided
    cfg, plan = decided  # type: ignore[misc]
    return cfg, plan


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) not in (1, 2):
        sys.exit("usage: python -m shardtune.train CONFIG.yaml [PLAN.json]  (normally started by `shardtune "
                 "finetune`, which resolves the run plan; without PLAN.json rank 0 resolves it)")
    cfg = build_config(argv[0])
    validate(cfg)
    plan = RunPlan.from_dict(json.loads(Path(argv[1]).read_text())) if len(argv) == 2 else None
    try:
        run(cfg, plan)
    except Stopped as stop:
        # A stop is no failure: no error file, only the exit code the launcher reads (128 + signal).
        raise SystemExit(stop.exit_code) from None


if __name__ == "__main__":
    distributed.worker_main(main)
