"""The fine-tuning recipe, run by every rank: set up (job.py) → train → save. Read top to bottom.

Started by the launcher (``python -m shardtune.train CONFIG.yaml``) or by torchrun with the same
arguments. Which objective it runs (SFT, DPO, ORPO, SimPO, GRPO) it never asks: the objective is a component
(train/objectives/) behind one step and one evaluation (train/step.py).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from shardtune.config import Config
from shardtune.errors import ShardtuneError
from shardtune.model.init_adapter import read_adapter
from shardtune.runplan import RunPlan
from shardtune.runtime import distributed
from shardtune.runtime.cpu_tuning import tune_malloc
from shardtune.runtime.device import device_type
from shardtune.runtime.distributed import Worker
from shardtune.runtime.failure import stage, stage_of
from shardtune.runtime.logs import setup_logging
from shardtune.runtime.memory import MemoryMonitor
from shardtune.runtime.worker_failures import Stopped
from shardtune.train.adapter import save_adapter
from shardtune.train.checkpoint import Checkpointer, TrainState
from shardtune.train.guard import TrainingGuard, refuse_no_op
from shardtune.train.job import Job, setup
from shardtune.train.metrics import MetricsLog, Progress, write_json_atomic
from shardtune.train.oom import out_of_memory
from shardtune.train.resolve import resolve
from shardtune.train.schedule import optimizer_and_schedule
from shardtune.train.stop import GenerationStopped, GracefulStop, stop_message
from shardtune.train.summary import run_summary
from shardtune.train.trackers import Trackers
from shardtune.train.training_data import training_lengths

log = logging.getLogger("shardtune")


def train(job: Job, memory: MemoryMonitor, out: Path) -> dict:
    """The training loop from the newest checkpoint (--resume) or the start; returns what the summary needs."""
    cfg = job.cfg
    optimizer, scheduler = optimizer_and_schedule(cfg, list(job.strategy.trainable(job.model).values()), job.steps)
    checkpoints = Checkpointer(cfg, job.model, job.strategy, job.built.adapter_keys, optimizer, scheduler,
                               job.model_dir, job.scaler, extra=job.rollouts)
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
    guard = TrainingGuard(out, cfg.train.lr, job.worker.is_main, cfg.lora.alpha, job.scaler)
    first = state.step  # a resumed run's checkpoint is there already
    with memory.phase("train"), GracefulStop(job.worker.device) as stop:
        for step in range(first, job.steps):
            started = time.perf_counter()
            try:
                result = job.step(step, stopping=stop.requested)
            except GenerationStopped:  # asked to stop while generating: the last finished step is kept
                stopped_by = stop.agreed()
                if state.step != first and not checkpoints.due(state.step):  # else it is written already
                    checkpoints.save(state)
                break
            job.scaler.unscale_(optimizer)  # fp16: clip and step see the true gradients
            grad_norm = job.strategy.clip_grad_norm(job.model, cfg.train.max_grad_norm)
            # before the optimizer step: no NaN weight is ever kept (fp16: an overflow is skipped and counted)
            guard.check(step + 1, result.loss, grad_norm)
            lr = scheduler.get_last_lr()[0]
            job.scaler.step(optimizer)  # fp16: skipped on every rank when a gradient is inf/NaN on one
            job.scaler.update()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            seconds = time.perf_counter() - started
            losses.append(result.loss)
            state.add(result.loss, result.tokens, seconds)
            fills.append(result.fill)
            record = {"step": step + 1, "loss": result.loss, "lr": lr, "grad_norm": grad_norm,
                      "tokens": result.tokens, "tokens_per_second": result.tokens / seconds,
                      "fill_ratio": result.fill, "seconds": seconds, "memory_mb": memory.now_mb(),
                      "peak_mb": memory.peak_so_far_mb(), **result.metrics, **guard.fields()}
            progress.update(record)  # before validation: the step's rate is the step's own
            if job.val and ((cfg.train.eval_every and (step + 1) % cfg.train.eval_every == 0) or step + 1 == job.steps):
                record.update(job.validate())
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


def starting_adapter(cfg: Config, is_main: bool = True) -> dict[str, torch.Tensor] | None:
    """The --init-adapter's tensors, to tell a run that learned nothing from it; None without one, or where it
    can no longer be read (moved or rewritten since the start): then the run's adapter is written unchecked
    rather than lost (said once, by ``is_main``)."""
    if not cfg.lora.init_adapter:
        return None
    try:
        return read_adapter(cfg.lora.init_adapter)[1]
    except (ShardtuneError, OSError) as err:
        if is_main:
            log.warning("--init-adapter %s cannot be read any more (%s): the adapter is written without comparing "
                        "it with the one the run started from", cfg.lora.init_adapter, err)
        return None


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
    if worker.is_main and plan.activation_offload and worker.device.type == "cpu":  # the launcher shows warnings only
        log.info("--activation-offload: on CPU it changes nothing (what it would move is in host memory already)")
    memory = MemoryMonitor(worker.device)
    try:
        load_started = time.perf_counter()
        with stage("load"):
            job = setup(cfg, worker, memory, plan)
        load_seconds = time.perf_counter() - load_started
        with stage("train"):
            result = train(job, memory, out)
        if result["stopped_by"]:
            result["trackers"].finish(None)  # the run goes on after --resume
            message = stop_message(result["stopped_by"], out, cfg.parallel.nnodes, cfg.parallel.node_rank)
            if worker.is_main:
                log.warning("%s", message)
            raise Stopped(result["stopped_by"], message)
        with memory.phase("save"), stage("save"):
            steps = result["state"].step

            def refuse(tensors: dict) -> None:  # a run that learned nothing writes no adapter (guard.py)
                refuse_no_op(tensors, cfg.lora, cfg.train.objective, steps, starting_adapter(cfg, worker.is_main))

            adapter = save_adapter(job.model, job.strategy, job.built.adapter_keys, out / "adapter", cfg.model.path,
                                   job.model_dir, refuse=refuse)
        summary = run_summary(job, plan, memory, result, adapter, load_seconds, time.perf_counter() - started)
        if worker.is_main:
            write_json_atomic(out / "summary.json", summary)
        result["trackers"].finish(summary)
        return summary
    except torch.OutOfMemoryError as err:  # a setting this device cannot hold: said with what would fit
        raise out_of_memory(err, stage_of(err), cfg, plan, worker.rank, worker.local_world_size) from None
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
