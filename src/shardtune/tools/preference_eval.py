"""`shardtune eval` on preference pairs: does the model prefer the chosen response, for the base and with the adapter?

For each model (the base, and base + adapter when one is given) and each pair, the summed log-probability
of the chosen and of the rejected response (response tokens only, tokenized as in training):
  accuracy      share of pairs with log p(chosen) > log p(rejected)
  mean margin   mean of log p(chosen) − log p(rejected)
With an adapter also DPO's implicit reward against the base as reference:
  reward accuracy  share of pairs with (log π − log ref)(chosen) > (log π − log ref)(rejected)
  reward margin    its mean difference (DPO's rewards/margins divided by β)
One process: the adapter is switched off for the base's pass, so one copy of the model serves both.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from shardtune.config import DataConfig

if TYPE_CHECKING:
    from shardtune.tools.generate import EvalModel


def is_preference_data(data: str | Path, fields: str = "") -> bool:
    """Whether the file's first record is a preference pair (has 'chosen' or 'rejected')."""
    from shardtune.train.data.read import read_records

    records = read_records(data, fields, check=lambda record, where: None)
    first = records[0][1] if records else None
    return isinstance(first, dict) and ("chosen" in first or "rejected" in first)


@torch.no_grad()
def pair_logps(model, examples, pad_id: int, batch_size: int, progress=None) -> torch.Tensor:
    """(pairs, 2) summed log-probs of every pair's chosen and rejected response, scored as training does
    (the loss head, attention without a square mask)."""
    from shardtune.model import attention
    from shardtune.train import loss_head
    from shardtune.train.data.batch import Batcher, Layout, sequence_sums

    param = next(model.parameters())
    n = len(examples) // 2
    out = []
    loss_head.install(model)
    with attention.shardtune_attention(model) as impl:
        batcher = Batcher(Layout(examples, 2, 0, pad_id, param.device, impl, param.dtype))
        for start in range(0, n, batch_size):
            fwd = batcher.padded(list(range(start, min(n, start + batch_size))))
            scores = loss_head.score(model, fwd.inputs, fwd.targets, scored=fwd.scored)
            out.append(sequence_sums(scores.logps, fwd).view(-1, 2).cpu())
            if progress is not None:
                progress(len(fwd.items))
    return torch.cat(out) if out else torch.zeros(0, 2)


def _figures(logps: torch.Tensor) -> dict[str, float]:
    margin = logps[:, 0] - logps[:, 1]
    return {"accuracy": (margin > 0).float().mean().item(), "mean_margin": margin.mean().item()}


def evaluate_preferences(subject: EvalModel, data: str | Path, seq_len: int = DataConfig().seq_len,
                         batch_size: int = 8, data_fields: str = "") -> dict[str, Any]:
    """The figures of the module docstring, for the base and (with an adapter) base + adapter."""
    from tqdm.auto import tqdm

    from shardtune.runtime.compat import adapters_disabled
    from shardtune.tools.generate import check_adapter_dir
    from shardtune.train.data.batch import pad_id
    from shardtune.train.data.pairs import PAIRS
    from shardtune.train.data.tokenize import load_dataset

    adapter, model_dir = subject.adapter, subject.model
    check_adapter_dir(adapter)
    model, tokenizer = subject.load()
    model.eval()
    dataset = load_dataset(data, tokenizer, seq_len, fields=data_fields, fmt=PAIRS)
    n = len(dataset.examples) // 2
    passes = 2 if adapter else 1
    with tqdm(total=n * passes, desc="eval pairs", unit="pair", dynamic_ncols=True) as bar:
        with adapters_disabled(model):
            base = pair_logps(model, dataset.examples, pad_id(tokenizer), batch_size, bar.update)
        tuned = pair_logps(model, dataset.examples, pad_id(tokenizer), batch_size, bar.update) if adapter else None
    result: dict[str, Any] = {"pairs": n, "truncated_pairs": dataset.truncated, "model": str(model_dir),
                              "adapter": str(adapter) if adapter else None, "data": str(data),
                              "base": _figures(base)}
    if tuned is not None:
        ratios = tuned - base
        reward_margin = ratios[:, 0] - ratios[:, 1]
        result["adapter_figures"] = {**_figures(tuned), "reward_accuracy": (reward_margin > 0).float().mean().item(),
                                     "reward_margin": reward_margin.mean().item()}
    return result


def table(result: dict[str, Any]) -> str:
    """The result side by side, for the terminal."""
    rows = [("pairs", str(result["pairs"]), "")]
    tuned = result.get("adapter_figures")
    for key, label in (("accuracy", "accuracy: log p(chosen) > log p(rejected)"),
                       ("mean_margin", "mean margin log p(chosen) - log p(rejected)")):
        fmt = "{:.1%}" if key == "accuracy" else "{:.3f}"
        rows.append((label, fmt.format(result["base"][key]), fmt.format(tuned[key]) if tuned else ""))
    if tuned:
        rows.append(("reward accuracy (vs base as reference)", "", f"{tuned['reward_accuracy']:.1%}"))
        rows.append(("reward margin (log-ratio, DPO's margin / beta)", "", f"{tuned['reward_margin']:.3f}"))
    width = max(len(r[0]) for r in rows)
    head = f"{'':<{width}}  {'base':>10}  {'+ adapter' if tuned else '':>10}"
    return "\n".join([head, *(f"{a:<{width}}  {b:>10}  {c:>10}" for a, b, c in rows)])
