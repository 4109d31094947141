"""`shardtune eval --reward ...` on prompts: the mean reward of the model's own completions, base against adapter.

For each model (the base, and base + adapter when one is given) every prompt of the file (GRPO's prompt
records, ``{"prompt": text or messages, ...fields}``) gets one completion, greedy by default (``temperature``
> 0: sampled, seeded per prompt as training samples), with the same KV-cache sampler training uses; the
reward functions score them with the records' fields as in training. Reported: each function's mean
(``rewards/<fn>/mean``), the weighted sum's mean (``reward``), the share of completions cut by the length
limit, and a few completions. One process: the adapter is switched off for the base's pass, so one copy
of the model serves both.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from shardtune.config import ConfigError, checked_reward_weights
from shardtune.train.rewards import RewardFunction

if TYPE_CHECKING:
    from shardtune.tools.generate import EvalModel

SAMPLES = 3
log = logging.getLogger("shardtune")


def evaluate_rewards(subject: EvalModel, data: str | Path, rewards: list[str], weights: str | None = None,
                     max_new_tokens: int = 64, batch_size: int = 8, temperature: float = 0.0, seed: int = 0,
                     seq_len: int = 512, data_fields: str = "") -> dict[str, Any]:
    """The figures of the module docstring, for the base and (with an adapter) base + adapter."""
    from shardtune.runtime.compat import adapters_disabled
    from shardtune.tools.generate import check_adapter_dir
    from shardtune.train.data.checks import prompt_warnings
    from shardtune.train.data.prompts import PROMPTS
    from shardtune.train.data.read import read_records
    from shardtune.train.data.tokenize import load_dataset
    from shardtune.train.rewards import load_rewards

    if max_new_tokens < 1:  # eval's 0 (loss only) leaves nothing to score here
        raise ConfigError(f"option 'max-new-tokens' ({max_new_tokens}) must be at least 1 with --reward: the "
                          "completions are what the reward functions score")
    functions = load_rewards(rewards, checked_reward_weights(weights, len(rewards)))
    check_adapter_dir(subject.adapter)
    model, tokenizer = subject.load()
    model.eval()
    prompts = load_dataset(data, tokenizer, seq_len, fields=data_fields, fmt=PROMPTS)
    records = read_records(data, data_fields, PROMPTS.check)
    for message in prompt_warnings(data, records):
        log.warning("%s", message)
    result: dict[str, Any] = {"prompts": len(records), "model": str(subject.model),
                              "adapter": str(subject.adapter) if subject.adapter else None, "data": str(data),
                              "temperature": temperature}
    with adapters_disabled(model):
        result["base"] = _figures(model, tokenizer, prompts.examples, records, functions, max_new_tokens,
                                  batch_size, temperature, seed, data)
    if subject.adapter:
        result["adapter_figures"] = _figures(model, tokenizer, prompts.examples, records, functions,
                                             max_new_tokens, batch_size, temperature, seed, data)
    return result


@torch.no_grad()
def _figures(model, tokenizer, examples, records, functions: list[RewardFunction], max_new_tokens: int,
             batch_size: int, temperature: float, seed: int, data: str | Path) -> dict[str, Any]:
    from shardtune.tools.generate import check_context
    from shardtune.train.data.batch import pad_id
    from shardtune.train.data.prompts import fields_of, prompt_of
    from shardtune.train.data.sources import location
    from shardtune.train.rewards import check_in_float32, completions_for, prompt_at, score, unscored, weights_of
    from shardtune.train.sampling import SamplingSettings, hf_cache, hf_next_logits, sample, stop_ids

    recs = [r for _, r in records]
    prompts = [prompt_of(r) for r in recs]
    # as `shardtune generate`: a prompt that fills the model's context is refused, an answer cut at its end
    context = check_context(model, prompts, [e.input_ids for e in examples], max_new_tokens)
    settings = SamplingSettings(max_new_tokens, tuple(stop_ids(model, tokenizer)), pad_id(tokenizer), temperature)
    device = next(model.parameters()).device
    done = []
    for start in range(0, len(examples), batch_size):
        rows = list(range(start, min(len(examples), start + batch_size)))
        room = max_new_tokens if context is None else \
            min(max_new_tokens, context - max(len(examples[i].input_ids) for i in rows))
        done += sample(hf_next_logits(model), [examples[i].input_ids for i in rows], [(i, 0) for i in rows],
                       dataclasses.replace(settings, max_new_tokens=room), seed, 0, hf_cache(model), device)
    ids = [c.ids for c in done]
    texts = tokenizer.batch_decode(ids, skip_special_tokens=True)
    fields = [fields_of(r) for r in recs]
    keys = sorted({k for f in fields for k in f})
    sources = [location(data, n) for n, _ in records]
    table = score(functions, prompts, completions_for(prompts, texts), ids, {k: [f.get(k) for f in fields]
                                                                             for k in keys}, sources=sources)
    none = unscored(functions, table, lambda i: prompt_at(sources[i], prompts[i]), "the held-out prompts",
                    "A mean reward of nothing measures nothing")
    total = (table * weights_of(functions)).nansum(dim=1)
    check_in_float32(functions, table, total[~none], "the held-out prompts")
    total[none] = math.nan
    out: dict[str, Any] = {"reward": _mean(total)}
    for j, fn in enumerate(functions):
        out[f"rewards/{fn.name}/mean"] = _mean(table[:, j])
    out["completions/clipped_ratio"] = sum(c.truncated for c in done) / max(1, len(done))
    out["completions/mean_length"] = sum(len(i) for i in ids) / max(1, len(ids))
    out["samples"] = [{"prompt": p, "completion": t, "reward": None if math.isnan(r) else float(r)}
                      for p, t, r in list(zip(prompts, texts, total.tolist()))[:SAMPLES]]
    return out


def _mean(x: torch.Tensor) -> float | None:
    value = torch.nanmean(x).item()
    return None if math.isnan(value) else value


def table(result: dict[str, Any]) -> str:
    """The result side by side, for the terminal."""
    base, tuned = result["base"], result.get("adapter_figures")
    keys = [k for k in base if k != "samples"]
    rows = [("prompts", str(result["prompts"]), "")]
    for k in keys:
        rows.append((k, _fmt(base[k]), _fmt(tuned[k]) if tuned else ""))
    width = max(len(r[0]) for r in rows)
    head = f"{'':<{width}}  {'base':>10}  {'+ adapter' if tuned else '':>10}"
    lines = [head, *(f"{a:<{width}}  {b:>10}  {c:>10}" for a, b, c in rows)]
    for name, figures in (("base", base), ("+ adapter", tuned)):
        for s in (figures or {}).get("samples", []):
            lines.append(f"\n[{name}] {s['prompt']!s:.120}\n    reward {_fmt(s['reward'])}: {s['completion']!s:.200}")
    return "\n".join(lines)


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"
