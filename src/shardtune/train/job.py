"""The job of a rank: everything the training loop needs, set up once (``setup``): the data, the model
built, sharded and loaded with its loss head and attention, the objective, its reference, the sampler (or,
for an objective that generates, its rollouts).

Tests and benches use ``setup(cfg)`` as their own entry point to a ready job.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from shardtune.config import Config, reward_weights
from shardtune.model import attention
from shardtune.model.directory import ModelDir, check_model_dir
from shardtune.model.meta import compute_dtype, vocab_size
from shardtune.parallel import Strategy
from shardtune.parallel.sharded_model import Built, build_model
from shardtune.runplan import RunPlan
from shardtune.runtime import distributed
from shardtune.runtime.distributed import Worker
from shardtune.runtime.logs import EVERY_RANK
from shardtune.runtime.memory import MemoryMonitor
from shardtune.train import loss_head
from shardtune.train.data.batch import Batcher, Layout, Sampler, pad_id
from shardtune.train.data.cache import cache_key, token_cache
from shardtune.train.data.pack import check_packing
from shardtune.train.data.read import read_records
from shardtune.train.data.records import Dataset
from shardtune.train.objectives import Objective, objective_of
from shardtune.train.reference import Reference, compute_reference, precomputed_reference, reference_key
from shardtune.train.remote_generation import RemoteGenerator
from shardtune.train.resolve import resolve_on
from shardtune.train.rewards import load_rewards
from shardtune.train.rollout import Rollouts
from shardtune.train.scaling import ShardedGradScaler, make_scaler
from shardtune.train.schedule import total_steps
from shardtune.train.step import StepResult, Trainee, evaluate, train_step
from shardtune.train.training_data import read_split

log = logging.getLogger("shardtune")


@dataclass
class Job:
    """Everything the training loop needs, built once by ``setup``."""

    cfg: Config
    worker: Worker
    built: Built
    objective: Objective
    train: Dataset
    val: Dataset | None
    batcher: Batcher  # the training data's forwards
    val_batcher: Batcher | None
    sampler: Sampler
    steps: int
    scaler: ShardedGradScaler  # fp16's loss scaling; passes everything through otherwise
    model_dir: ModelDir
    reference: Reference | None = None  # the reference model's values of the training items
    val_reference: Reference | None = None
    rollouts: Rollouts | None = None  # an objective that generates (GRPO): its generation batches


    @property
    def model(self) -> nn.Module:
        return self.built.model

    @property
    def strategy(self) -> Strategy:
        return self.built.strategy

    def trainee(self, reference: Reference | None) -> Trainee:
        return Trainee(self.model, self.strategy, self.objective, reference, self.worker,
                       self.cfg.parallel.activation_offload)

    def step(self, step: int, stopping: Callable[[], bool] | None = None) -> StepResult:
        """Forward and backward of this rank's share of global batch ``step`` (no optimizer step). ``stopping``:
        whether this rank was asked to stop; a GRPO step still generating then raises GenerationStopped on every
        rank (train/stop.py)."""
        if self.rollouts is not None:  # the policy's own completions, sampled when the step starts a batch of them
            batcher, batch, split = self.rollouts.batch(step, stopping)
        else:
            batcher, batch, split = self.batcher, self.sampler.global_batch(step), self.sampler.plan
        forwards = batcher.step(batch, split, self.worker.rank, self.cfg.data.packing)
        return train_step(self.trainee(self.reference), batcher, batch, forwards, self.scaler)

    def validate(self) -> dict[str, float]:
        """``val_loss`` (the objective's loss over the whole validation set) and ``val_`` + its metrics."""
        assert self.val is not None and self.val_batcher is not None
        self.model.eval()
        n_items = len(self.val.examples) // self.objective.per_item
        figures = evaluate(self.trainee(self.val_reference), self.val_batcher, n_items,
                           self.sampler.plan.micro_batch_size)
        self.strategy.after_inference(self.model)
        self.model.train()
        return {f"val_{k}": v for k, v in figures.items()}


def setup(cfg: Config, worker: Worker | None = None, memory: MemoryMonitor | None = None,
          plan: RunPlan | None = None) -> Job:
    """The job of ``plan`` on this rank: data tokenized (or mapped from preflight's cache), the model built,
    sharded and loaded, the loss head and attention installed, the reference ready. Defaults, for callers
    that are their own entry point (tests, benches): this process's worker, a memory monitor, and
    ``resolve_on(worker, cfg)``."""
    from transformers import AutoTokenizer

    worker = worker or distributed.init_worker(cfg.parallel.device, cfg.parallel.cpu_offload,
                                               cfg.parallel.collective_timeout)
    memory = memory or MemoryMonitor(worker.device)
    plan = plan or resolve_on(worker, cfg)
    plan.check(cfg, worker.world_size, worker.device.type)  # the batches too: this rank makes them

    model_dir = check_model_dir(cfg.model.path, cfg.model.trust_remote_code)
    tokenizer = AutoTokenizer.from_pretrained(model_dir.path, trust_remote_code=model_dir.trust_remote_code)
    objective = objective_of(cfg)
    # Before any collective: a bad token id stops every rank here, with the record named.
    vocab = vocab_size(model_dir)
    train_data = read_split(cfg, cfg.data.train, tokenizer, vocab)
    val_data = read_split(cfg, cfg.data.val, tokenizer, vocab) if cfg.data.val else None
    _warn_about_cut_records(cfg, objective, train_data)
    # peft (and the transformers modelling code it brings) is code, not loading: imported before the
    # phase starts, it is part of the runtime the planner holds fixed (memory_model.RUNTIME_CPU_MB).
    import peft  # noqa: F401

    with memory.phase("load"):
        built = build_model(cfg, worker, plan)
    model = built.strategy.unwrap(built.model)
    if cfg.data.packing:
        check_packing(model)
    impl = attention.use_shardtune_attention(model)
    loss_head.install(model, plan.loss_chunk or None)
    built.model.train()

    def batcher(data: Dataset) -> Batcher:
        return Batcher(Layout(data.examples, objective.per_item, cfg.data.seq_len, pad_id(tokenizer), worker.device,
                              impl, compute_dtype(cfg), built.strategy.context))

    n_items = len(train_data.examples) // objective.per_item
    job = Job(cfg, worker, built, objective, train_data, val_data, batcher(train_data),
              batcher(val_data) if val_data is not None else None, Sampler(n_items, plan.batch, cfg.train.seed),
              total_steps(cfg, objective.epoch_items(len(train_data.examples))),
              make_scaler(cfg.model.dtype, worker.device), model_dir)
    if objective.uses_reference:
        job.reference, job.val_reference = _references(job, tokenizer)
    if objective.generates:
        job.rollouts = Rollouts(cfg, job.trainee(None), tokenizer, list(train_data.examples),
                                read_records(cfg.data.train, cfg.data.fields, objective.records.check), plan.batch,
                                load_rewards(cfg.grpo.reward or [], reward_weights(cfg.grpo.reward_weights)), impl,
                                compute_dtype(cfg), plan.generation,
                                RemoteGenerator(cfg, worker, built.strategy, built.adapter_keys, model_dir, vocab)
                                if cfg.grpo.vllm_url else None)
    torch.manual_seed(cfg.train.seed + worker.rank)  # LoRA dropout differs per rank, reproducibly
    return job


def _warn_about_cut_records(cfg: Config, objective: Objective, data: Dataset) -> None:
    what = "records" if objective.per_item == 1 else "pairs"
    if data.truncated and objective.per_item == 1:  # pairs: preflight warned, with which side is cut
        log.warning("%d of %d training records were cut to --seq-len %d", data.truncated,
                    len(data.examples) + data.without_targets, cfg.data.seq_len, extra=EVERY_RANK)
    if data.without_targets:
        log.warning("%d training %s have no target token within --seq-len and are skipped",
                    data.without_targets, what, extra=EVERY_RANK)


def _references(job: Job, tokenizer) -> tuple[Reference, Reference | None]:
    """The reference of the training (and validation) items: computed in every step, or with
    --precompute-reference (and always with --init-adapter, whose adapter is the reference and is trained)
    computed once before the first step, as the model is then, and kept beside the token cache."""
    cfg, worker = job.cfg, job.worker
    adapters_on = cfg.lora.init_adapter is not None
    live = Reference(job.objective, adapters_on=adapters_on)
    if not (cfg.preference.precompute_reference or adapters_on):
        return live, live if job.val is not None else None
    tables = []
    for path, data, batcher in ((cfg.data.train, job.train, job.batcher), (cfg.data.val, job.val, job.val_batcher)):
        if data is None:
            tables.append(None)
            continue
        data_key = cache_key(path, tokenizer, cfg.data.seq_len, f"{cfg.data.fields}|{job.objective.records.name}")
        key = reference_key(data_key, cfg.model.path, cfg.model.dtype, cfg.model.quantize, cfg.lora.init_adapter)

        def compute(data=data, batcher=batcher) -> torch.Tensor:
            return compute_reference(job.model, live, batcher, len(data.examples) // job.objective.per_item,
                                     job.sampler.plan.micro_batch_size, worker.rank, worker.world_size)

        table = precomputed_reference(token_cache(cfg), key, compute, worker.is_main, worker.world_size, str(path))
        tables.append(Reference(job.objective, table))
    job.strategy.after_inference(job.model)
    return tables[0], tables[1]
