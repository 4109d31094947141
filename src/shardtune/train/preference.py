"""Preference pairs through the model: each forward's layout, sequence log-probs, and the reference.

Pair ``p`` of a dataset is examples ``2p`` (chosen) and ``2p + 1`` (rejected); the sampler draws pair
indices, so ``--batch-size`` counts pairs and a pair's two sequences always go to the same rank and the
same forward (its loss needs both). Within a forward, sequence ``2k`` is the chosen and ``2k + 1`` the
rejected response of the forward's ``k``-th pair, padded (one row each) or packed (a pair's two sequences
side by side in one row of up to 2 × ``--seq-len`` tokens, so that any pair fits).

The reference is the policy's own sharded base with every adapter layer switched off
(``compat.adapters_disabled``), run under ``no_grad``: no second model and no saved activations. Under
FSDP it is a collective like any forward, so every rank runs it for every forward, empty ones included.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from shardtune.runtime.compat import adapters_disabled
from shardtune.train.data import Example, collate
from shardtune.train.loss import next_token_losses
from shardtune.train.objectives import METRICS, Objective, PairTerms, pair_terms
from shardtune.train.packing import collate_packed, forwards_per_rank


@dataclass
class PairForward:
    """One forward of whole pairs."""

    inputs: dict[str, torch.Tensor]
    labels: torch.Tensor
    sequences: torch.Tensor  # (rows, width): the local sequence number of each token, -1 on padding
    pairs: list[int]  # the dataset's pair indices, in the forward's order
    real_tokens: int
    positions: int


def pair_examples(examples: Sequence[Example], p: int) -> tuple[Example, Example]:
    return examples[2 * p], examples[2 * p + 1]


def padded_forward(examples: Sequence[Example], pairs: list[int], pad_id: int, device: torch.device) -> PairForward:
    """Each response its own row, right-padded: rows chosen₀, rejected₀, chosen₁, …"""
    rows = [e for p in pairs for e in pair_examples(examples, p)]
    batch = collate(rows, pad_id, device)
    sequences = torch.arange(len(rows), device=device)[:, None].expand_as(batch["labels"]).clone()
    sequences[batch["attention_mask"] == 0] = -1
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    return PairForward(inputs, batch["labels"], sequences, pairs, sum(len(e.input_ids) for e in rows),
                       batch["input_ids"].numel())


def packed_forwards(batch: Sequence[int], examples: Sequence[Example], rows_per_forward: int, world_size: int,
                    seq_len: int, rank: int, pad_id: int, device: torch.device, one_row: bool, attention: str,
                    dtype: torch.dtype) -> list[PairForward]:
    """This rank's forwards of global batch ``batch`` (pair indices), its pairs packed into rows of up to
    2 × ``seq_len`` tokens; every rank runs as many forwards as the rank that needs the most."""
    per_rank = len(batch) // world_size
    shares = [batch[r * per_rank:(r + 1) * per_rank] for r in range(world_size)]
    mine = forwards_per_rank(shares, lambda p: sum(len(e.input_ids) for e in pair_examples(examples, p)),
                             2 * seq_len, rows_per_forward)[rank]
    out = []
    for rows in mine:
        packed = collate_packed([[e for p in row for e in pair_examples(examples, p)] for row in rows], pad_id,
                                device, one_row)
        counts = [2 * len(row) for row in rows]
        if one_row:
            counts = [sum(counts)]
        starts = torch.tensor([0, *counts[:-1]], device=device).cumsum(0) if counts else torch.zeros(1, device=device)
        sequences = torch.where(packed.segments >= 0, packed.segments + starts[:, None].long(), -1)
        out.append(PairForward(packed.model_inputs(attention, dtype), packed.labels, sequences,
                               [p for row in rows for p in row], packed.real_tokens, packed.positions))
    return out


def sequence_logps(logits: torch.Tensor, labels: torch.Tensor, sequences: torch.Tensor, n: int) -> torch.Tensor:
    """Summed log-probabilities of each of the ``n`` sequences' target tokens, in fp32, with grad."""
    losses = next_token_losses(logits, labels)  # position t scores token t + 1
    owner = torch.full_like(sequences, n)
    owner[:, :-1] = sequences[:, 1:]
    owner[owner < 0] = n  # padding: a bucket that is dropped (its losses are 0 anyway)
    sums = torch.zeros(n + 1, dtype=torch.float32, device=logits.device).index_add(0, owner.flatten(), losses.flatten())
    return -sums[:n]


def target_counts(examples: Sequence[Example], pairs: list[int], device: torch.device) -> torch.Tensor:
    """(pairs, 2): target tokens of each pair's chosen and rejected response."""
    return torch.tensor([[e.targets for e in pair_examples(examples, p)] for p in pairs], dtype=torch.float32,
                        device=device).reshape(-1, 2)


def forward_logps(model: nn.Module, fwd: PairForward) -> torch.Tensor:
    """(pairs, 2) summed log-probs of ``fwd``'s chosen and rejected responses; differentiable."""
    logits = model(**fwd.inputs).logits
    # The loss keeps the logits for its own backward; a name holding them would keep them through backward.
    return sequence_logps(logits, fwd.labels, fwd.sequences, 2 * len(fwd.pairs)).view(-1, 2)


@torch.no_grad()
def reference_logps(model: nn.Module, fwd: PairForward, adapters_on: bool = False) -> torch.Tensor:
    """(pairs, 2) log-probs under the reference: the base model (adapters off), or with ``adapters_on`` the
    model as it is (the initial adapter, before the first step)."""
    if adapters_on:
        return forward_logps(model, fwd)
    with adapters_disabled(model):
        return forward_logps(model, fwd)


def terms_of(objective: Objective, logps: torch.Tensor, counts: torch.Tensor,
             reference: torch.Tensor | None) -> PairTerms:
    ref = (reference[:, 0], reference[:, 1]) if reference is not None else (None, None)
    return pair_terms(objective, logps[:, 0], logps[:, 1], counts[:, 0], counts[:, 1], *ref)


def my_pairs(n_pairs: int, rank: int, world_size: int) -> tuple[list[int], int]:
    """This rank's share of ``n_pairs`` (every world_size-th), and how many forwards of one pair each every
    rank runs (the largest share: a sharded model needs every rank in every forward)."""
    return list(range(rank, n_pairs, world_size)), -(-n_pairs // world_size)


def lockstep_forwards(examples: Sequence[Example], micro: int, pad_id: int, device: torch.device, rank: int,
                      world_size: int) -> Iterator[tuple[int, list[int], PairForward]]:
    """(position in this rank's share, its pairs, their forward) for every pair of ``examples``, ``micro`` a
    forward; a rank out of pairs gets a stand-in forward (pair 0, empty pair list), so that it still joins
    every collective of a sharded model."""
    mine, per_rank = my_pairs(len(examples) // 2, rank, world_size)
    for start in range(0, per_rank, micro):
        chunk = mine[start:start + micro]
        yield start, chunk, padded_forward(examples, chunk or [0], pad_id, device)


@torch.no_grad()
def evaluate_pairs(model: nn.Module, objective: Objective, examples: Sequence[Example], micro: int, pad_id: int,
                   device: torch.device, rank: int, world_size: int, reference: torch.Tensor | None = None
                   ) -> torch.Tensor:
    """This rank's sums over its share of the pairs: [pair losses, chosen NLL, chosen target tokens, pairs,
    *METRICS sums]; the caller adds them over ranks. ``reference``: precomputed (pairs, 2) log-probs, else the
    base model's are computed here (DPO). The caller chooses ``model.eval()`` / ``train()``."""
    sums = torch.zeros(4 + len(METRICS), dtype=torch.float64, device=device)
    for _, chunk, fwd in lockstep_forwards(examples, micro, pad_id, device, rank, world_size):
        ref = None
        if objective.reference:
            ref = reference[fwd.pairs].to(device) if reference is not None else reference_logps(model, fwd)
        logps = forward_logps(model, fwd)
        if not chunk:
            continue
        counts = target_counts(examples, chunk, device)
        terms = terms_of(objective, logps, counts, ref)
        sums += torch.cat([torch.stack([terms.losses.sum(), terms.nll_sum, counts[:, 0].sum(),
                                        torch.tensor(float(len(chunk)), device=device)]),
                           terms.metric_sums()]).double()
    return sums


def pair_summary(sums: torch.Tensor) -> dict[str, float]:
    """The loss and TRL's metrics from ``evaluate_pairs``' sums (added over ranks)."""
    losses, nll, chosen_tokens, pairs, *rest = sums.tolist()
    return {"loss": losses / pairs + (nll / chosen_tokens if chosen_tokens else 0.0),
            **{name: v / pairs for name, v in zip(METRICS, rest)}}
