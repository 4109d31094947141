"""GRPO's rewards, advantages and loss family against TRL 1.16's ``GRPOTrainer`` (the oracle), fp32, one process.

The same tiny model and LoRA adapter (random non-zero B, so that policy and reference differ), the same prompts
and the SAME completions (TRL's generation is replaced by a function returning them), the same reward
functions. TRL computes the advantages, the old and reference log-probs and its loss with its own code
(``_generate_and_score_completions`` then ``compute_loss``); shardtune's side scores the completions with
``rewards.score``, computes ``grpo_advantages.group_advantages`` and ``grpo_loss.grpo_terms`` from per-token
log-probs of a plain forward of the same peft model (right-padded rows, where TRL left-pads the prompts).
The loss, the metrics and every LoRA gradient must agree within 1e-5 relative, for every loss type, β = 0 and
β > 0, one iteration and the second of num_iterations = 2 (after a step moved the adapter, so ratios clip),
and token- and sequence-level importance sampling. Then the batch cut over 2 "ranks" × 2 micro-batches
(sums added, metrics all-reduced) must give TRL's loss and gradients under 4-step gradient accumulation.
TRL's vLLM importance-sampling correction is driven through TRL's own code too: vLLM's log-probs are injected
beside the completions, and TRL's ratio, ``sampling/*`` metrics, loss and gradients must be ours, in each mode.
So is TRL's off-policy sequence masking (``off_policy_mask_threshold``), against the old policy's log-probs and
against vLLM's, with its correction on and off.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import pytest
import torch
import torch.nn.functional as F
import trl  # noqa: F401  (the oracle: in the test extra, so never skipped)

from shardtune.train.grpo_advantages import completion_metrics, group_advantages
from shardtune.train.grpo_loss import (
    LOSS_TYPES,
    Counts,
    GRPOSettings,
    StepMetrics,
    grpo_terms,
    loss_mask,
    off_policy_mask,
)
from shardtune.train.rewards import RewardFunction, score, weights_of
from shardtune.train.sampler_correction import MODES, importance_ratio, sampler_table

from closeness import rel
from tiny import make_model

G = 4  # completions per prompt
MAX_LEN = 8  # max_completion_length
TEMPERATURE = 0.9  # not 1: the log-probs of the loss are those of logits / temperature, as TRL's
EOS, PAD = 257, 258
PROMPTS = [{"prompt": f"Q{i}: what is {i}+{i}?" + " ok" * i, "answer": str(2 * i)} for i in range(3)]
ROWS = [p for p in PROMPTS for _ in range(G)]  # what TRL's sampler hands a generation batch: each prompt G times
TOLERANCE = 1e-5
pytestmark = pytest.mark.usefixtures("one_thread")


def _completions() -> list[list[int]]:
    """12 completions of 1..8 byte tokens; every third ends with EOS (the others are cut by the limit)."""
    g = torch.Generator().manual_seed(3)
    out = []
    for i in range(len(ROWS)):
        n = int(torch.randint(1, MAX_LEN + 1, (1,), generator=g))
        ids = torch.randint(0, 256, (n,), generator=g).tolist()
        out.append(ids[:-1] + [EOS] if i % 3 == 0 else torch.randint(0, 256, (MAX_LEN,), generator=g).tolist()
                   if i % 3 == 1 else ids)
    out[6] = [EOS]  # a one-token completion: unscorable below (every function answers None)
    return out


def digits(prompts, completions, completion_ids, answer, **kwargs):
    """A reward that varies within groups, None for one-token completions."""
    return [None if len(ids) == 1 else (sum(ids) % 5) / 2 + float(a in c)
            for c, ids, a in zip(completions, completion_ids, answer)]


def brevity(prompts, completions, completion_ids, **kwargs):
    return [None if ids == [EOS] else -len(c) / 8 for c, ids in zip(completions, completion_ids)]


REWARDS = [RewardFunction("digits", digits, 1.0), RewardFunction("brevity", brevity, 0.5)]


@dataclass
class Oracle:
    trainer: object
    model: torch.nn.Module
    tokenizer: object
    completions: list[list[int]]


@pytest.fixture(scope="module")
def oracle(tmp_path_factory) -> Oracle:
    """One TRL trainer for the whole module (its construction is the slow part); each case sets its knobs."""
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    root = tmp_path_factory.mktemp("grpo-oracle")
    make_model(root / "model", chat_template=False)
    tokenizer = AutoTokenizer.from_pretrained(root / "model")
    args = GRPOConfig(output_dir=str(root / "trl"), per_device_train_batch_size=len(ROWS), num_generations=G,
                      max_completion_length=MAX_LEN, temperature=TEMPERATURE, report_to=[], use_cpu=True, bf16=False,
                      fp16=False, gradient_checkpointing=False, seed=0, reward_weights=[r.weight for r in REWARDS])
    trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(root / "model", dtype=torch.float32),
                          reward_funcs=[r.fn for r in REWARDS], args=args, train_dataset=Dataset.from_list(PROMPTS),
                          processing_class=tokenizer,
                          peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                                                 lora_dropout=0.0))
    completions = _completions()
    trainer._generate_single_turn = lambda prompt_ids, images, fields, n, **kw: ([list(c) for c in completions], None)
    trainer.model.train()
    return Oracle(trainer, trainer.model, tokenizer, completions)


def lora_params(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def set_adapter(model: torch.nn.Module, seed: int, scale: float) -> None:
    """Every LoRA weight random (B too, so that the policy is not the base)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in lora_params(model).values():
            p.copy_(torch.randn(p.shape, generator=g) * scale)
            p.grad = None


def step_adapter(model: torch.nn.Module, seed: int, scale: float) -> None:
    """What an optimizer step would do between two iterations on one batch: move every LoRA weight a little."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in lora_params(model).values():
            p.add_(torch.randn(p.shape, generator=g) * scale)


def token_logps(model, prompt_ids: list[list[int]], completion_ids: list[list[int]], width: int,
                entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(rows, width) log-probs of each completion token at TEMPERATURE (and the entropies there), from one plain
    forward of right-padded prompt + completion rows: what the shared loss head will return."""
    seqs = [p + c for p, c in zip(prompt_ids, completion_ids)]
    length = max(map(len, seqs))
    ids = torch.full((len(seqs), length), PAD)
    attention = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s)
        attention[i, :len(s)] = 1
    logp = F.log_softmax(model(input_ids=ids, attention_mask=attention).logits.float() / TEMPERATURE, dim=-1)
    # position t predicts token t + 1: completion token j of row i sits at len(prompt_i) + j
    where = torch.tensor([[min(len(p) - 1 + j, length - 2) for j in range(width)] for p in prompt_ids])
    targets = ids[:, 1:].gather(1, where)
    picked = logp[:, :-1].gather(1, where.unsqueeze(-1).expand(-1, -1, logp.size(-1)))
    logps = picked.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ent = -(picked.exp() * picked).sum(-1).detach() if entropy else None
    return logps, ent


def configure(o: Oracle, settings: GRPOSettings, iterations: int, scale: str = "group",
              aggregation: str = "sum_then_normalize", mask_truncated: bool = False, chunks: int = 1) -> None:
    t = o.trainer
    t.loss_type, t.beta, t.importance_sampling_level = settings.loss_type, settings.beta, \
        settings.importance_sampling_level
    t.epsilon_low, t.epsilon_high, t.args.delta = settings.eps_low, settings.eps_high, settings.delta
    t.scale_rewards, t.multi_objective_aggregation = scale, aggregation
    t.mask_truncated_completions, t.num_iterations = mask_truncated, iterations
    t.off_policy_mask_threshold = settings.off_policy_mask_threshold
    t.current_gradient_accumulation_steps = t.args.steps_per_generation = chunks
    t._metrics["train"].clear()


def trl_generation(o: Oracle, beta: float, scale: str = "group", aggregation: str = "sum_then_normalize",
                   mask_truncated: bool = False) -> dict:
    """TRL's batch (advantages, the old policy's and the reference's log-probs) and its metrics, with the
    adapter at its first weights; num_iterations 2, so that the old log-probs are kept."""
    configure(o, GRPOSettings(beta=beta), 2, scale, aggregation, mask_truncated)
    set_adapter(o.model, 11, 0.3)
    inputs = o.trainer._generate_and_score_completions([dict(r) for r in ROWS])
    return {"inputs": inputs, "metrics": {k: v[-1] for k, v in o.trainer._metrics["train"].items()}}


def trl_loss(o: Oracle, inputs: dict, settings: GRPOSettings, iterations: int, chunks: int = 1) -> dict:
    """TRL's loss (its chunks' losses added, as its gradient accumulation does), metrics and LoRA gradients;
    iteration 2 after a step moved the adapter, iteration 1 without old log-probs (ratio 1, as TRL's)."""
    from trl.trainer.utils import split_tensor_dict

    configure(o, settings, iterations, chunks=chunks)
    set_adapter(o.model, 11, 0.3)
    inputs = dict(inputs)
    if iterations > 1:
        step_adapter(o.model, 12, 0.25)
    else:
        del inputs["old_per_token_logps"]
    if not settings.beta:
        del inputs["ref_per_token_logps"]
    loss = 0.0
    for part in split_tensor_dict(inputs, chunks):
        part["num_items_in_batch"] = inputs["num_items_in_batch"]
        chunk_loss = o.trainer.compute_loss(o.model, part)
        chunk_loss.backward()
        loss += chunk_loss.item()
    grads = {n: p.grad.clone() for n, p in lora_params(o.model).items()}
    metrics = {k: sum(v) / len(v) for k, v in o.trainer._metrics["train"].items()}
    return {"loss": loss, "grads": grads, "metrics": metrics}


def our_generation(o: Oracle, scale: str = "group", aggregation: str = "sum_then_normalize",
                   mask_truncated: bool = False) -> dict:
    """shardtune's rewards, advantages, loss mask, and the old policy's and the reference's log-probs."""
    model = o.model
    set_adapter(model, 11, 0.3)
    prompt_ids = [o.tokenizer(r["prompt"])["input_ids"] for r in ROWS]
    completions = o.tokenizer.batch_decode(o.completions, skip_special_tokens=True)
    rewards = score(REWARDS, [r["prompt"] for r in ROWS], completions, o.completions,
                    {"answer": [r["answer"] for r in ROWS]})
    adv = group_advantages(rewards, weights_of(REWARDS), G, scale, aggregation, [r.name for r in REWARDS])
    lengths = torch.tensor([len(c) for c in o.completions])
    truncated = torch.tensor([c[-1] != EOS for c in o.completions])
    width = int(lengths.max())
    with torch.no_grad():
        old = token_logps(model, prompt_ids, o.completions, width)[0]
        with model.disable_adapter():
            ref = token_logps(model, prompt_ids, o.completions, width)[0]
    return {"prompt_ids": prompt_ids, "advantages": adv, "old": old, "ref": ref,
            "mask": loss_mask(lengths, truncated, width, mask_truncated),
            "metrics": {**adv.metrics, **completion_metrics(lengths.tolist(), truncated.tolist())}}


def our_loss(o: Oracle, gen: dict, settings: GRPOSettings, iterations: int,
             parts: list[list[int]] | None = None, is_ratio: torch.Tensor | None = None,
             sampling: torch.Tensor | None = None) -> dict:
    """shardtune's loss on the same batch; ``parts``: the rows of each (rank, micro-batch), their sums added and
    their metrics reduced as ranks would (default: the batch whole, one micro-batch); ``is_ratio``: a vLLM
    sampler's importance-sampling ratio (the old log-probs are then used even on a first iteration, as TRL);
    ``sampling``: the vLLM sampler's log-probs (rows, width), for off-policy masking."""
    model, mask = o.model, gen["mask"]
    set_adapter(model, 11, 0.3)
    if iterations > 1:
        step_adapter(model, 12, 0.25)
    old = gen["old"] if iterations > 1 or is_ratio is not None else None
    ref = gen["ref"] if settings.beta else None
    parts = parts or [list(range(len(ROWS)))]
    counts = Counts(len(ROWS), int(mask.sum()), micro_batches=len(parts))
    loss, metrics = 0.0, StepMetrics()
    for rows in parts:
        logps, entropies = token_logps(model, [gen["prompt_ids"][i] for i in rows], [o.completions[i] for i in rows],
                                       mask.size(1), entropy=True)
        terms = grpo_terms(settings, logps, mask[rows], gen["advantages"].advantages[rows], counts,
                           None if old is None else old[rows], None if ref is None else ref[rows], entropies,
                           None if is_ratio is None else is_ratio[rows],
                           None if sampling is None else sampling[rows])
        terms.loss.backward()
        loss += terms.loss.item()
        metrics = metrics.add(terms.metrics)
    grads = {n: p.grad.clone() for n, p in lora_params(model).items()}
    return {"loss": loss, "grads": grads, "metrics": metrics.values()}


@pytest.fixture(scope="module")
def batch(oracle) -> tuple[dict, dict]:
    """TRL's and shardtune's generation batch (scale_rewards group): the loss cases share them."""
    return trl_generation(oracle, beta=0.04), our_generation(oracle)


def assert_same_step(ours: dict, theirs: dict, case: str) -> None:
    assert ours["grads"].keys() == theirs["grads"].keys()
    worst = max(rel(ours["grads"][n], theirs["grads"][n]) for n in theirs["grads"])
    # The loss adds terms of size |A| ~ 1 that nearly cancel (the first iteration's without KL is −mean(A) ≈ 0):
    # its rounding is that of those terms, not of the small result, so it is judged relative to their size (1)
    # where it is smaller: the fp32 kernels' rounding differs between CPU kinds (AVX2, AVX-512), and with it
    # the rounding of those terms.
    loss_rel = rel(ours["loss"], theirs["loss"], floor=1.0)
    print(f"\n{case}: loss {theirs['loss']:.6g} rel {loss_rel:.1e}, worst LoRA gradient rel {worst:.1e}")
    assert loss_rel <= TOLERANCE, (ours["loss"], theirs["loss"])
    assert worst <= TOLERANCE
    assert any(g.abs().max() > 0 for g in theirs["grads"].values())  # gradients that can differ


def assert_same_metrics(ours: dict, theirs: dict) -> None:
    for name, value in theirs.items():
        if name in ("num_tokens", "step_time"):  # the trainer's bookkeeping, not GRPO's
            continue
        assert name in ours, f"TRL logs {name}, we do not"
        mine = ours[name]
        assert (math.isnan(mine) and math.isnan(value)) or math.isclose(mine, value, rel_tol=1e-5, abs_tol=1e-6), \
            (name, mine, value)


# Every loss type, with and without KL, first and second iteration, token and sequence ratios; on the first
# iteration without KL the sequence ratio's loss and gradients are the token ratio's (r = 1, ∇r = mean ∇logπ).
CASES = [(loss, beta, iterations, level) for loss in LOSS_TYPES for beta in (0.0, 0.04) for iterations in (1, 2)
         for level in ("token", "sequence") if beta or iterations > 1 or level == "token"]


@pytest.mark.parametrize("loss,beta,iterations,level", CASES,
                         ids=[f"{c[0]}-beta{c[1]}-it{c[2]}-{c[3]}" for c in CASES])
def test_loss_gradients_and_metrics_equal_trl(oracle, batch, loss, beta, iterations, level):
    # Sequence ratios (geometric means over tokens) stray less from 1: GSPO's smaller clip range makes them clip
    low, high = (0.2, 0.28) if level == "token" else (0.03, 0.04)
    settings = GRPOSettings(loss_type=loss, beta=beta, epsilon=low, epsilon_high=high, importance_sampling_level=level,
                            max_completion_length=MAX_LEN)
    theirs_gen, ours_gen = batch
    theirs = trl_loss(oracle, theirs_gen["inputs"], settings, iterations)
    ours = our_loss(oracle, ours_gen, settings, iterations)
    assert_same_step(ours, theirs, f"{loss} beta={beta} iterations={iterations} {level}")
    assert_same_metrics(ours["metrics"], theirs["metrics"])
    if iterations > 1 and loss in ("grpo", "dapo"):  # the second iteration clips, both ways: the case tests the clip
        assert theirs["metrics"]["clip_ratio/low_mean"] > 0 and theirs["metrics"]["clip_ratio/high_mean"] > 0


def test_old_and_reference_logps_equal_trl(batch):
    theirs, ours = batch
    mask = ours["mask"]
    assert rel(ours["old"] * mask, theirs["inputs"]["old_per_token_logps"][:, :mask.size(1)] * mask) < TOLERANCE
    assert rel(ours["ref"] * mask, theirs["inputs"]["ref_per_token_logps"][:, :mask.size(1)] * mask) < TOLERANCE
    assert rel(ours["old"] * mask, ours["ref"] * mask) > 1e-3  # the adapter matters: policy and reference differ


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("aggregation", ["sum_then_normalize", "normalize_then_sum"])
def test_advantages_and_reward_metrics_equal_trl(oracle, scale, aggregation):
    theirs = trl_generation(oracle, 0.0, scale, aggregation)
    ours = our_generation(oracle, scale, aggregation)
    assert torch.allclose(ours["advantages"].advantages, theirs["inputs"]["advantages"], rtol=1e-6, atol=1e-6)
    assert ours["advantages"].advantages[6] == 0  # unscorable: every function answered None
    assert_same_metrics(ours["metrics"], theirs["metrics"])
    for name in ("reward", "reward_std", "rewards/digits/mean", "rewards/brevity/std", "frac_reward_zero_std",
                 "completions/clipped_ratio", "completions/mean_terminated_length"):
        assert name in theirs["metrics"] and name in ours["metrics"]


@pytest.mark.parametrize("loss", ["grpo", "dapo", "bnpo"])
def test_masked_truncated_completions_equal_trl(oracle, loss):
    settings = GRPOSettings(loss_type=loss, beta=0.04, max_completion_length=MAX_LEN)
    theirs_gen = trl_generation(oracle, 0.04, mask_truncated=True)
    ours_gen = our_generation(oracle, mask_truncated=True)
    mask = ours_gen["mask"]
    assert torch.equal(mask, theirs_gen["inputs"]["completion_mask"][:, :mask.size(1)].float())
    assert mask.sum() < sum(len(c) for c in oracle.completions)  # some were masked
    theirs = trl_loss(oracle, theirs_gen["inputs"], settings, 2)
    ours = our_loss(oracle, ours_gen, settings, 2)
    assert_same_step(ours, theirs, f"{loss} mask_truncated")
    assert_same_metrics(ours["metrics"], theirs["metrics"])


# Rows of each (rank, micro-batch): 2 ranks of 6 completions, 2 micro-batches of 3 each; prompt 1's group
# (rows 4-7) sits on both ranks. TRL's 4-step gradient accumulation cuts the batch into the same 4 chunks.
SPLIT = [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]


@pytest.mark.parametrize("loss", LOSS_TYPES)
def test_split_over_ranks_and_micro_batches_equals_trl_accumulation(oracle, batch, loss):
    settings = GRPOSettings(loss_type=loss, beta=0.04, epsilon_high=0.28, max_completion_length=MAX_LEN)
    theirs_gen, ours_gen = batch
    theirs = trl_loss(oracle, theirs_gen["inputs"], settings, 2, chunks=len(SPLIT))
    split = our_loss(oracle, ours_gen, settings, 2, parts=SPLIT)
    assert_same_step(split, theirs, f"{loss} 2 ranks x 2 micro-batches")
    whole = our_loss(oracle, ours_gen, settings, 2)
    if loss != "bnpo":  # bnpo divides by each micro-batch's own tokens: it depends on the cut, as in TRL
        assert_same_step(split, whole, f"{loss} split = whole")
        for name, value in whole["metrics"].items():
            assert math.isclose(split["metrics"][name], value, rel_tol=1e-6, abs_tol=1e-9) or \
                (math.isnan(value) and math.isnan(split["metrics"][name])), name


def sampler_logps(o: Oracle, old: torch.Tensor) -> list[list[float | None]]:
    """What a vLLM sampler would report for the completion tokens: the trainer's log-probs, each shifted by seeded
    noise (so that token and sequence ratios fall on both sides of the bounds), one token unscored (null, NaN in
    TRL: left uncorrected)."""
    g = torch.Generator().manual_seed(5)
    out: list[list[float | None]] = [(old[i, :len(c)] + torch.randn(len(c), generator=g) * 0.8).tolist()
                                     for i, c in enumerate(o.completions)]
    out[1][2] = None
    return out


def trl_vllm_step(o: Oracle, settings: GRPOSettings, iterations: int, mode: str | None, low: float | None,
                  high: float | None, sampled: list, mask_truncated: bool = False) -> dict:
    """TRL's generation batch with vLLM's log-probs injected beside the completions and its correction on (``mode``
    None: off), then its loss, metrics and LoRA gradients on that batch (iteration 2 after a step moved the
    adapter)."""
    t = o.trainer
    configure(o, settings, iterations, mask_truncated=mask_truncated)
    t.use_vllm, t.vllm_importance_sampling_correction = True, mode is not None
    t.vllm_importance_sampling_mode = mode
    t.vllm_importance_sampling_clip_min, t.vllm_importance_sampling_clip_max = low, high
    single_turn = t._generate_single_turn
    t._generate_single_turn = lambda prompt_ids, images, fields, n, **kw: (
        [list(c) for c in o.completions], [list(row) for row in sampled])
    try:
        set_adapter(o.model, 11, 0.3)
        inputs = t._generate_and_score_completions([dict(r) for r in ROWS])
        if iterations > 1:
            step_adapter(o.model, 12, 0.25)
        loss = t.compute_loss(o.model, inputs)
        loss.backward()
    finally:
        t._generate_single_turn = single_turn
        t.use_vllm = t.vllm_importance_sampling_correction = False
    grads = {n: p.grad.clone() for n, p in lora_params(o.model).items()}
    metrics = {k: v[-1] for k, v in t._metrics["train"].items()}
    return {"loss": loss.item(), "grads": grads, "metrics": metrics, "ratio": inputs.get("importance_sampling_ratio"),
            "old": inputs.get("old_per_token_logps"), "sampling": inputs["sampling_per_token_logps"]}


# TRL's vLLM importance-sampling correction: each mode with TRL's default bounds on dapo's first iteration (where
# the old log-probs are computed only for it), with both bounds on grpo's second iteration with KL, with GSPO's
# sequence ratio, with vespo (token modes only, as TRL), and with truncated completions masked.
VLLM_CASES = [(mode, "dapo", 0.0, 1, "token", None, 3.0, False) for mode in MODES] + \
    [(mode, "grpo", 0.04, 2, "token", 0.5, 2.0, False) for mode in MODES] + \
    [("sequence_mask", "grpo", 0.04, 2, "sequence", None, 3.0, False),
     ("token_truncate", "grpo", 0.0, 1, "sequence", 0.5, 2.0, False),
     ("token_truncate", "vespo", 0.0, 2, "token", None, 3.0, False),
     ("token_mask", "vespo", 0.04, 2, "token", 0.5, 2.0, False),
     ("sequence_mask", "dapo", 0.04, 2, "token", None, 3.0, True),
     ("token_mask", "bnpo", 0.0, 1, "token", 0.5, 2.0, True)]


@pytest.mark.parametrize("mode,loss,beta,iterations,level,low,high,mask_truncated", VLLM_CASES,
                         ids=[f"{c[0]}-{c[1]}-beta{c[2]}-it{c[3]}-{c[4]}-{c[5]}-{c[6]}{'-masktrunc' * c[7]}"
                              for c in VLLM_CASES])
def test_vllm_importance_sampling_equals_trl(oracle, mode, loss, beta, iterations, level, low, high,
                                             mask_truncated):
    settings = GRPOSettings(loss_type=loss, beta=beta, epsilon=0.2, epsilon_high=0.28,
                            importance_sampling_level=level, max_completion_length=MAX_LEN)
    ours_gen = our_generation(oracle, mask_truncated=mask_truncated)
    sampled = sampler_logps(oracle, ours_gen["old"])
    theirs = trl_vllm_step(oracle, settings, iterations, mode, low, high, sampled, mask_truncated)
    mask = ours_gen["mask"]
    ratio, found = importance_ratio(ours_gen["old"], sampler_table(sampled, mask.size(1)), mask, mode, low, high)
    # the ratio TRL's loss multiplies by, and the old log-probs it was made from (computed even on iteration 1)
    assert rel(ours_gen["old"] * mask, theirs["old"][:, :mask.size(1)] * mask) < TOLERANCE
    assert ratio.shape == (len(ROWS), 1 if mode.startswith("sequence") else mask.size(1))
    assert rel(ratio, theirs["ratio"][:, :ratio.size(1)]) < TOLERANCE
    bounded = (ratio == 0).any() if mode.endswith("mask") else \
        ((ratio == high) | (ratio == (low if low is not None else -1))).any()
    assert bounded and not torch.all(ratio == 1)  # the case exercises the bounds
    ours = our_loss(oracle, ours_gen, settings, iterations, is_ratio=ratio)
    assert_same_step(ours, theirs, f"vLLM {mode} [{low}, {high}] {loss} beta={beta} it={iterations} {level}")
    for name in ("sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max",
                 "sampling/importance_sampling_ratio/min", "sampling/importance_sampling_ratio/mean",
                 "sampling/importance_sampling_ratio/max"):
        assert math.isclose(found[name], theirs["metrics"][name], rel_tol=1e-5, abs_tol=1e-6), \
            (name, found[name], theirs["metrics"][name])
    assert_same_metrics({**ours["metrics"], **ours_gen["metrics"], **found}, theirs["metrics"])


def current_logps(o: Oracle, gen: dict, iterations: int) -> torch.Tensor:
    """The policy's log-probs where the loss of iteration ``iterations`` is taken (the adapter as trl_loss sets it)."""
    set_adapter(o.model, 11, 0.3)
    if iterations > 1:
        step_adapter(o.model, 12, 0.25)
    with torch.no_grad():
        return token_logps(o.model, gen["prompt_ids"], o.completions, gen["mask"].size(1))[0]


def assert_masks_some(gen: dict, logps: torch.Tensor, sampling: torch.Tensor, threshold: float) -> None:
    """TRL's own mask drops some of the negative-advantage completions, and keeps others: the case tests the mask."""
    from trl import GRPOTrainer

    adv = gen["advantages"].advantages.unsqueeze(1)
    keep = GRPOTrainer.get_off_policy_mask(adv, logps, sampling, gen["mask"], threshold).squeeze(1)
    assert torch.equal(keep, off_policy_mask(adv, logps, sampling, gen["mask"], threshold).squeeze(1))
    negative = (adv.squeeze(1) < 0).nonzero().squeeze(1).tolist()
    dropped = (keep == 0).nonzero().squeeze(1).tolist()
    assert dropped and set(dropped) < set(negative), (dropped, negative)


OPM_THRESHOLD = 0.03  # the second iteration's mean log-ratios of the negative-advantage rows: -0.009 .. 0.10
# Every loss type on the second iteration (the old policy's log-probs against the moved adapter's), β = 0 and > 0,
# token and sequence ratios; and a first iteration, where TRL compares the policy with itself: nothing is masked.
OPM_CASES = [("dapo", 0.0, 2, "token"), ("grpo", 0.04, 2, "token"), ("bnpo", 0.04, 2, "sequence"),
             ("dr_grpo", 0.0, 2, "sequence"), ("cispo", 0.04, 2, "token"), ("sapo", 0.0, 2, "token"),
             ("luspo", 0.04, 2, "sequence"), ("vespo", 0.04, 2, "token"), ("dapo", 0.04, 1, "token")]


@pytest.mark.parametrize("loss,beta,iterations,level", OPM_CASES,
                         ids=[f"{c[0]}-beta{c[1]}-it{c[2]}-{c[3]}" for c in OPM_CASES])
def test_off_policy_mask_equals_trl(oracle, batch, loss, beta, iterations, level):
    settings = GRPOSettings(loss_type=loss, beta=beta, epsilon=0.2, epsilon_high=0.28, importance_sampling_level=level,
                            max_completion_length=MAX_LEN, off_policy_mask_threshold=OPM_THRESHOLD)
    theirs_gen, ours_gen = batch
    theirs = trl_loss(oracle, theirs_gen["inputs"], settings, iterations)
    ours = our_loss(oracle, ours_gen, settings, iterations)
    assert_same_step(ours, theirs, f"off-policy mask {loss} beta={beta} iterations={iterations} {level}")
    assert_same_metrics(ours["metrics"], theirs["metrics"])
    unmasked = our_loss(oracle, ours_gen, replace(settings, off_policy_mask_threshold=None), iterations)
    if iterations == 1:  # the policy against itself, detached: a mean log-ratio of 0 <= δ everywhere
        assert_same_step(unmasked, theirs, "no mask on a first iteration")
        return
    assert_masks_some(ours_gen, current_logps(oracle, ours_gen, iterations), ours_gen["old"], OPM_THRESHOLD)
    assert rel(unmasked["loss"], theirs["loss"], floor=1e-2) > 1e-3  # and the loss is not the unmasked one


def drifted_sampler(o: Oracle, old: torch.Tensor) -> list[list[float | None]]:
    """vLLM's log-probs as ``sampler_logps`` (noise, one null), with two negative-advantage completions (rows 4
    and 10) 0.4 a token more likely to vLLM than to the trainer: their mean log-ratio, above δ, masks them."""
    out = sampler_logps(o, old)
    for row in (4, 10):
        out[row] = [x + 0.4 for x in out[row]]
    return out


VLLM_OPM_THRESHOLD = 0.1
# vLLM's log-probs against the policy's: with the correction on (the old log-probs are then taken even on a first
# iteration) and off (no old log-probs on a first iteration: the mask still compares vLLM's with the policy's).
VLLM_OPM_CASES = [("sequence_mask", "dapo", 0.0, 1, "token"), ("token_truncate", "grpo", 0.04, 2, "token"),
                  (None, "dapo", 0.0, 1, "token"), (None, "grpo", 0.04, 2, "sequence"),
                  (None, "vespo", 0.0, 1, "token")]


@pytest.mark.parametrize("mode,loss,beta,iterations,level", VLLM_OPM_CASES,
                         ids=[f"{c[0]}-{c[1]}-beta{c[2]}-it{c[3]}-{c[4]}" for c in VLLM_OPM_CASES])
def test_off_policy_mask_against_vllm_logps_equals_trl(oracle, mode, loss, beta, iterations, level):
    settings = GRPOSettings(loss_type=loss, beta=beta, epsilon=0.2, epsilon_high=0.28,
                            importance_sampling_level=level, max_completion_length=MAX_LEN,
                            off_policy_mask_threshold=VLLM_OPM_THRESHOLD)
    ours_gen = our_generation(oracle)
    mask = ours_gen["mask"]
    sampled = drifted_sampler(oracle, ours_gen["old"])
    theirs = trl_vllm_step(oracle, settings, iterations, mode, None, 3.0, sampled)
    table = sampler_table(sampled, mask.size(1))
    assert torch.equal(table.isnan(), theirs["sampling"][:, :mask.size(1)].isnan())  # the null, as TRL's NaN
    ratio = importance_ratio(ours_gen["old"], table, mask, mode, None, 3.0)[0] if mode is not None else None
    ours = our_loss(oracle, ours_gen, settings, iterations, is_ratio=ratio, sampling=table)
    assert_same_step(ours, theirs, f"off-policy mask vs vLLM {mode} {loss} beta={beta} it={iterations} {level}")
    assert_same_metrics({**ours["metrics"], **ours_gen["metrics"]}, {k: v for k, v in theirs["metrics"].items()
                                                                     if not k.startswith("sampling/")})
    assert_masks_some(ours_gen, current_logps(oracle, ours_gen, iterations), table, VLLM_OPM_THRESHOLD)
    unmasked = our_loss(oracle, ours_gen, replace(settings, off_policy_mask_threshold=None), iterations,
                        is_ratio=ratio, sampling=table)
    assert rel(unmasked["loss"], theirs["loss"], floor=1e-2) > 1e-3


def test_metrics_reduce_across_ranks_as_one_batch():
    """StepMetrics.all_reduce with a stand-in for dist.all_reduce: two ranks' sums, minima and maxima."""
    settings = GRPOSettings(loss_type="dapo", beta=0.1, importance_sampling_level="token")
    g = torch.Generator().manual_seed(0)
    logps, old, ref = (-torch.rand(6, 5, generator=g) * 3 for _ in range(3))
    mask = (torch.rand(6, 5, generator=g) > 0.3).float()
    adv = torch.randn(6, generator=g)
    counts = Counts.of(mask)
    whole = grpo_terms(settings, logps, mask, adv, counts, old, ref).metrics.values()
    ranks = [grpo_terms(settings, logps[s], mask[s], adv[s], counts, old[s], ref[s]).metrics
             for s in (slice(0, 2), slice(2, 6))]
    packed = {}

    def fake_all_reduce(tensor: torch.Tensor, op: str) -> None:  # called once per op by each "rank" in turn
        packed.setdefault(op, []).append(tensor)
    for m in ranks:
        m.all_reduce(fake_all_reduce)
    combine = {"sum": lambda ts: sum(ts), "min": lambda ts: torch.minimum(*ts), "max": lambda ts: torch.maximum(*ts)}
    reduced = {op: combine[op](ts) for op, ts in packed.items()}
    packed.clear()
    ranks[0].all_reduce(lambda tensor, op: tensor.copy_(reduced[op]))
    assert ranks[0].values().keys() == whole.keys()
    for name, value in whole.items():
        assert math.isclose(ranks[0].values()[name], value, rel_tol=1e-9, abs_tol=1e-12), name


def test_settings_refuse_unknown_values():
    from shardtune.config import ConfigError

    with pytest.raises(ConfigError, match="not one of grpo, dr_grpo, dapo, bnpo"):
        GRPOSettings(loss_type="ppo")
    with pytest.raises(ConfigError, match="importance sampling level 'tokens'"):
        GRPOSettings(importance_sampling_level="tokens")
    with pytest.raises(ConfigError, match="delta"):
        GRPOSettings(delta=0.5)
    for threshold in (0.0, -0.5, math.inf, math.nan):
        with pytest.raises(ConfigError, match="off_policy_mask_threshold"):
            GRPOSettings(off_policy_mask_threshold=threshold)
    assert replace(GRPOSettings(), epsilon_high=None).eps_high == 0.2
