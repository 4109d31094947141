"""GRPO's rollouts: each generation batch sampled by the policy, scored, and made into a step's items.

Generation batch ``k`` serves optimizer steps k·μ … k·μ + μ − 1 (μ = --num-iterations). Made before its
first step, on every rank together:

1. its prompts: batch k of a seeded sampler over the prompts (--batch-size / G of them), each repeated for
   its G completions: rows group-major, so row r is completion r mod G of prompt r div G;
2. each rank samples its own rows (the rows a step will train on it), seeded by (prompt, completion index,
   k): the completions are the same however many ranks there are (train/generation.py); or, with
   --vllm-url, a vLLM server samples every row, synced first with the policy's adapter, and each rank keeps
   its own rows (train/remote_generation.py);
3. each rank scores its rows with the reward functions; rows, rewards (or a reward function's failure,
   raised on every rank) are exchanged, so every rank holds the whole batch;
4. the advantages over each prompt's whole group (grpo_advantages.py), the same numbers on every rank;
5. with μ > 1 the policy's log-probs now (the "old" policy of the ratio), with β > 0 the reference's (the
   base with the adapter off, or the --init-adapter weights swapped in): no_grad forwards of the rows a step
   will train, exchanged too;
6. with --vllm-url and its importance-sampling correction on (the default, as TRL's), the old log-probs are
   taken even with μ = 1 (as TRL), and the ratio of the trainer's to the server's probabilities of the sampled
   tokens made from them (train/sampler_correction.py), with its ``sampling/*`` metrics. With
   --off-policy-mask-threshold the server's log-probs are kept too, for the loss's off-policy mask to measure
   against (grpo_loss.py).

The batch is kept in the resumable checkpoint (``state_dict``): a run stopped mid-batch resumes on the same
completions. A few completions with their rewards go to ``OUT/completions.jsonl`` per generation batch.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from shardtune.config import Config
from shardtune.runplan import GATHERED_PER_TOKEN, BatchSplit, GenerationWeights
from shardtune.runtime import distributed
from shardtune.runtime.compat import adapters_disabled
from shardtune.runtime.files import write_text_atomic
from shardtune.train.data.batch import Batcher, Layout, Sampler, pad_id
from shardtune.train.data.prompts import fields_of, prompt_of
from shardtune.train.data.records import IGNORE, Example
from shardtune.train.data.sources import location
from shardtune.train.generation import generate, inference
from shardtune.train.grpo_advantages import completion_metrics, group_advantages
from shardtune.train.loss_head import score
from shardtune.train.metrics import read_metrics
from shardtune.train.objectives.grpo import Grpo, Rollout, make_mask, per_sequence
from shardtune.train.remote_generation import RemoteGenerator
from shardtune.train.rewards import (
    RewardError,
    RewardFunction,
    RewardLog,
    check_in_float32,
    completions_for,
    prompt_at,
    unscored,
    weights_of,
)
from shardtune.train.rewards import score as rewards_of
from shardtune.train.sampler_correction import importance_ratio, sampler_table, wants_sampler_logps
from shardtune.train.sampling import Completion, SamplingSettings, stop_ids
from shardtune.train.step import Trainee
from shardtune.train.stop import GenerationStopped

log = logging.getLogger("shardtune")

#: completions written to OUT/completions.jsonl per generation batch
SAMPLES = 4
COMPLETIONS = "completions.jsonl"


class Rollouts:
    """The generation batches of a GRPO run, made as the steps need them (module doc)."""

    def __init__(self, cfg: Config, trainee: Trainee, tokenizer, prompts: list[Example],
                 records: list[tuple[int, dict]], split: BatchSplit, rewards: list[RewardFunction], attention: str,
                 dtype: torch.dtype, weights: GenerationWeights = GATHERED_PER_TOKEN,
                 remote: RemoteGenerator | None = None) -> None:
        assert isinstance(trainee.objective, Grpo)
        self.cfg, self.t, self.tokenizer, self.split, self.rewards = cfg, trainee, tokenizer, split, rewards
        self.objective: Grpo = trainee.objective
        self.prompts, self.records = prompts, records
        g = cfg.grpo
        self.G, self.mu = g.num_generations, g.num_iterations
        self.sampler = Sampler(len(prompts), BatchSplit(split.batch_size // self.G, 1, 1), cfg.train.seed)
        model = trainee.strategy.unwrap(trainee.model)
        self.settings = SamplingSettings(g.max_completion_length, tuple(stop_ids(model, tokenizer)), pad_id(tokenizer),
                                         g.temperature, g.top_p, g.top_k)
        self.layout = (pad_id(tokenizer), attention, dtype)
        self.out = Path(cfg.output.out)
        self.trimmed = False
        # β > 0 against --init-adapter: its weights, kept to swap in for the reference's forwards
        self.initial = ({n: p.detach().clone() for n, p in trainee.strategy.trainable(trainee.model).items()}
                        if g.beta > 0 and cfg.lora.init_adapter else None)
        self.batcher: Batcher | None = None
        self.weights = weights  # how the generation holds the weights (RunPlan.generation)
        self.remote = remote  # --vllm-url: the completions come from a vLLM server instead

    # ------------------------------------------------------------------------------------------ a step's items

    def batch(self, step: int, stopping: Callable[[], bool] | None = None
              ) -> tuple[Batcher, list[int], BatchSplit]:
        """The batcher of step ``step``'s generation batch (made first when the step starts a new one), its
        items (every row) and how they split over ranks. ``stopping``: whether this rank was asked to stop
        (train/stop.py); when any rank was, the generation ends early and GenerationStopped is raised on every
        rank, before anything of the batch is kept."""
        index = step // self.mu
        if self.objective.rollout is None or self.objective.rollout.index != index:
            self._make(index, step, stopping)
        assert self.batcher is not None
        return self.batcher, list(range(self.split.batch_size)), self.split

    def _make(self, index: int, step: int, stopping: Callable[[], bool] | None = None) -> None:
        w = self.t.worker
        prompts = self.sampler.global_batch(index)
        rows = [(p, c) for p in prompts for c in range(self.G)]
        per_rank = len(rows) // w.world_size
        mine = rows[w.rank * per_rank:(w.rank + 1) * per_rank]
        sampled: list | None = None  # the server's log-probs of every row's tokens (correction or mask on)
        if self.remote is not None:  # every row from the server, the same on every rank: this rank keeps its own
            groups = self.remote.completions(self.t.model, [self.prompts[p].input_ids for p in prompts], self.G,
                                             self.settings, step, index)
            every = [c for group in groups for c in group]
            done = every[w.rank * per_rank:(w.rank + 1) * per_rank]
            if wants_sampler_logps(self.cfg.grpo):
                sampled = [c.logps for c in every]
        else:
            done = generate(self.t.model, self.t.strategy, w, [self.prompts[p].input_ids for p, _ in mine], mine,
                            self.settings, self.cfg.train.seed, index, self.weights, stopping=stopping)
        try:
            # asked to stop after the generation's last token (or where no token could ask every rank)
            if stopping is not None and distributed.all_reduce_max(int(stopping()), w.device):
                raise GenerationStopped
            self._made(index, step, prompts, mine, done, sampled)
        except BaseException:
            # a carried generation's weights are gathered still: sharded (their frozen shards refilled) before
            # anything else may read them
            self.t.strategy.after_inference(self.t.model)
            raise

    def _made(self, index: int, step: int, prompts: list[int], mine: list[tuple[int, int]], done: list[Completion],
              sampled: list | None) -> None:
        """Generation batch ``index``'s completions (this rank's, ``done``) scored and exchanged, its advantages,
        and the log-probs the loss needs (``_make``)."""
        w = self.t.worker
        ids = [c.ids for c in done]
        try:
            found: object = self._score(mine, ids, step)
        except RewardError as err:
            found = err
        shares = distributed.all_gather_object((ids, [c.truncated for c in done], found)) if w.world_size > 1 \
            else [(ids, [c.truncated for c in done], found)]
        failed = next((s[2] for s in shares if isinstance(s[2], RewardError)), None)
        if failed is not None:
            raise failed
        completions = [c for s in shares for c in s[0]]
        truncated = [t for s in shares for t in s[1]]
        scores = torch.cat([s[2][0] for s in shares])  # type: ignore[index]
        logged, columns = RewardLog.merged([s[2][1] for s in shares], [len(s[0]) for s in shares])  # type: ignore[index]
        names = [r.name for r in self.rewards]
        adv = group_advantages(scores, weights_of(self.rewards), self.G, self.cfg.grpo.scale_rewards, names=names)
        self._check_scored(scores, adv.rewards, adv.metrics["reward_std"], prompts, step)
        # the functions' own (log_metric), beside ours under their names as in TRL; ours win a name both use
        metrics = {**logged, **adv.metrics, **completion_metrics([len(c) for c in completions], truncated)}
        rollout = Rollout(index, prompts, completions, truncated, scores, adv.advantages,
                          make_mask(completions, truncated, self.cfg.grpo.mask_truncated_completions), metrics,
                          self._micro_batches(), temperature=self.settings.temperature)
        self._install(rollout)
        g = self.cfg.grpo
        table = sampler_table(sampled, rollout.width) if sampled is not None else None
        correct = table is not None and g.vllm_importance_sampling != "off"
        if self.mu > 1 or correct:
            rollout.old = self._logps(contextlib.nullcontext)
        if correct:
            assert rollout.old is not None and table is not None
            rollout.is_ratio, found = importance_ratio(rollout.old, table, rollout.mask, g.vllm_importance_sampling,
                                                       g.vllm_importance_sampling_min, g.vllm_importance_sampling_max)
            rollout.metrics.update(found)
        if g.off_policy_mask_threshold is not None:
            rollout.sampling = table  # the mask measures against the sampler's own log-probs (else the old ones)
        if self.cfg.grpo.beta > 0:
            rollout.ref = self._logps(self._reference)
        self._write_samples(rollout, adv.rewards, step, columns)

    def _check_scored(self, scores: torch.Tensor, totals: torch.Tensor, spread: float, prompts: list[int],
                      step: int) -> None:
        """What the batch's rewards can teach, on every rank alike (every rank holds them all). A completion every
        function answered None for has no reward and advantage 0 (TRL warns): said once a batch. A batch with no
        reward at all, or whose weighted rewards overflow float32 (TRL's dtype) in their sum or spread, leaves
        nothing to learn: the run stops (exit 2) rather than train on zeros."""
        def where(i: int) -> str:
            line, record = self.records[prompts[i // self.G]]
            return prompt_at(location(self.cfg.data.train, line), prompt_of(record))

        batch = f"the generation batch at step {step + 1}"
        none = unscored(self.rewards, scores, where, batch, "GRPO learns nothing from such a batch")
        names = ", ".join(repr(r.name) for r in self.rewards)
        if bool(none.any()) and self.t.worker.is_main:
            log.warning("step %d: %d of %d completions got no reward (every function, %s, answered None), so they "
                        "teach nothing (advantage 0, as in TRL); the first on %s", step + 1, int(none.sum()),
                        len(none), names, where(int(none.nonzero()[0])))
        scored = totals[~none]
        check_in_float32(self.rewards, scores, scored, batch, spread if scored.numel() > 1 else None)

    def _micro_batches(self) -> int:
        s = self.split
        return s.world_size * max(1, -(-s.per_rank // s.micro_batch_size))

    def _install(self, rollout: Rollout) -> None:
        """``rollout`` as the objective's current batch, with the batcher of its prompt + completion rows."""
        examples = []
        for r, ids in enumerate(rollout.completions):
            prompt = list(self.prompts[rollout.prompts[r // self.G]].input_ids)
            examples.append(Example(prompt + ids, [IGNORE] * len(prompt) + ids))
        pad, attention, dtype = self.layout
        seq_len = self.cfg.data.seq_len + self.cfg.completion_room()
        self.batcher = Batcher(Layout(examples, 1, seq_len, pad, self.t.worker.device, attention, dtype))
        self.objective.rollout = rollout

    # ------------------------------------------------------------------------------------------ scoring

    def _score(self, mine: list[tuple[int, int]], ids: list[list[int]], step: int) -> tuple[torch.Tensor, RewardLog]:
        """(rows, functions) rewards of this rank's rows, and what the functions logged (``log_extra``'s values as
        JSON holds them: they go to completions.jsonl, through every rank)."""
        records = [self.records[p][1] for p, _ in mine]
        prompts = [prompt_of(r) for r in records]
        texts = self.tokenizer.batch_decode(ids, skip_special_tokens=True)
        fields = [fields_of(r) for r in records]
        keys = sorted({k for f in fields for k in f})
        sources = [location(self.cfg.data.train, self.records[p][0]) for p, _ in mine]
        log = RewardLog()
        table = rewards_of(self.rewards, prompts, completions_for(prompts, texts), ids,
                           {k: [f.get(k) for f in fields] for k in keys}, step=step, log=log, sources=sources)
        for column, values in log.extra.items():
            log.extra[column] = json.loads(json.dumps(values, default=str))
        return table, log

    # ------------------------------------------------------------------------------------------ log-probs

    def _logps(self, context) -> torch.Tensor:
        """(rows, width) log-probs of every row's completion tokens under the model in ``context``: each rank
        scores the rows it trains, in the forwards it trains them in; the rows are exchanged."""
        assert self.batcher is not None and self.objective.rollout is not None
        w, t = self.t.worker, self.t
        width = self.objective.rollout.width
        mine: dict[int, torch.Tensor] = {}
        forwards = self.batcher.step(list(range(self.split.batch_size)), self.split, w.rank, self.cfg.data.packing)
        # right after a carried generation: the weights it left gathered serve these forwards too, and stay for
        # the training (the adapter is the same until its backward)
        with inference(t.model, t.strategy, settle=not self.weights.carries), context():
            for fwd in forwards:
                scores = score(t.model, fwd.inputs, fwd.targets, self.objective.temperature, fwd.scored)
                seq = per_sequence(scores.logps, fwd, width).cpu()
                mine.update(zip(fwd.items, seq[:len(fwd.items)]))
        shares = distributed.all_gather_object(mine) if w.world_size > 1 else [mine]
        found = {i: v for share in shares for i, v in share.items()}
        return torch.stack([found[i] for i in range(self.split.batch_size)])

    @contextlib.contextmanager
    def _reference(self) -> Iterator[None]:
        """The reference model: the base with every adapter layer off, or the --init-adapter weights in place
        of the trained ones (restored after)."""
        if self.initial is None:
            with adapters_disabled(self.t.model):
                yield
            return
        self.t.strategy.after_inference(self.t.model)  # no unit keeps a gathered copy of the trained weights
        # asked after: a gathered unit's parameters are its unsharded copies, freed as it is sharded again
        params = self.t.strategy.trainable(self.t.model)
        trained = {n: p.detach().clone() for n, p in params.items()}
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(self.initial[n])
        try:
            yield
        finally:
            self.t.strategy.after_inference(self.t.model)
            with torch.no_grad():
                for n, p in params.items():
                    p.copy_(trained[n])

    # ------------------------------------------------------------------------------------------ output, resume

    def _write_samples(self, rollout: Rollout, rewards: torch.Tensor, step: int,
                       columns: dict[str, list] | None = None) -> None:
        """A few completions with their rewards and the functions' ``log_extra`` ``columns`` (one value per row), to
        OUT/completions.jsonl (rank 0); lines of steps after ``step`` (a run resumed from an earlier checkpoint, or
        an older run's) are dropped first."""
        if not self.t.worker.is_main:
            return
        file = self.out / COMPLETIONS
        if not self.trimmed:  # whole lines only (a torn last line dropped, said), replaced at once
            self.trimmed = True
            records, note = read_metrics(file, what="completions record") if file.is_file() else ([], None)
            if note:
                log.warning("%s", note)
            write_text_atomic(file, "".join(json.dumps(r) + "\n" for r in records if r["step"] <= step))
        texts = self.tokenizer.batch_decode(rollout.completions[:SAMPLES], skip_special_tokens=True)
        with open(file, "a") as f:
            for r, text in enumerate(texts):
                record = self.records[rollout.prompts[r // self.G]][1]
                line = {"step": step + 1, "prompt": prompt_of(record),
                        "completion": text, "reward": _number(rewards[r]),
                        "rewards": {fn.name: _number(rollout.rewards[r, j]) for j, fn in enumerate(self.rewards)},
                        "advantage": _number(rollout.advantages[r]), "truncated": rollout.truncated[r]}
                if columns:
                    line["extra"] = {column: values[r] for column, values in columns.items()}
                f.write(json.dumps(line) + "\n")

    def state_dict(self) -> dict | None:
        """The current generation batch (what a checkpoint keeps), or None."""
        return self.objective.rollout.state() if self.objective.rollout is not None else None

    def load_state_dict(self, state: dict | None) -> None:
        """The checkpoint's generation batch as the current one, unless options changed on resume (a warning
        said which) make it a batch this run cannot train on: then the step samples its batch anew (said)."""
        if state is None:
            return
        rollout = Rollout(**state)
        misfit = self._misfit(rollout)
        if misfit is None:
            self._install(rollout)
        elif self.t.worker.is_main:
            log.warning("the checkpoint's generation batch (step %d on) was made %s; it is sampled anew",
                        rollout.index * self.mu + 1, misfit)

    def _misfit(self, rollout: Rollout) -> str | None:
        """Why a saved generation batch does not fit this run's batch and loss, or None."""
        rows, groups = len(rollout.completions), len(rollout.prompts)
        if rows != self.split.batch_size or groups * self.G != rows:
            return (f"of {rows} completions, {rows // max(1, groups)} per prompt (now --batch-size "
                    f"{self.split.batch_size}, --num-generations {self.G})")
        if rollout.micro_batches != self._micro_batches():
            return f"for {rollout.micro_batches} forwards a step over all ranks (now {self._micro_batches()})"
        if rollout.temperature is not None and rollout.temperature != self.settings.temperature:
            return f"at --temperature {rollout.temperature:g}, its log-probs too (now {self.settings.temperature:g})"
        longest, limit = max((len(c) for c in rollout.completions), default=0), self.settings.max_new_tokens
        if longest > limit:
            return f"with completions of up to {longest} tokens (now --max-completion-length {limit})"
        if self.mu > 1 and rollout.old is None:
            return "without the log-probs at sampling that --num-iterations above 1 needs"
        if self.cfg.grpo.beta > 0 and rollout.ref is None:
            return "without the reference's log-probs that --grpo-beta above 0 needs"
        return None


def _number(x: torch.Tensor) -> float | None:
    v = float(x)
    return None if math.isnan(v) else v
