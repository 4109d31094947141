"""The validation loss: one loop for the recipe's ``--val`` and for ``shardtune eval``.

Records are split over ranks by ``data.shard_indices`` (every world_size-th record), so each is seen
exactly once whatever the number of ranks; a rank returns its sums and the caller adds them up.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from shardtune.train.data import Example, collate, shard_indices
from shardtune.train.loss import next_token_loss_sum


@torch.no_grad()
def loss_sums(model: nn.Module, examples: list[Example], pad_id: int, device: torch.device, batch_size: int,
              rank: int, world_size: int, lockstep: bool,
              on_batch: Callable[[int, int], None] | None = None) -> tuple[float, int]:
    """This rank's share of the validation data: (sum of target-token losses, number of target tokens).

    ``lockstep``: the model is sharded, so every rank must take part in every forward; a rank with
    fewer records then runs padding batches (a record of another rank) whose loss it does not count.
    The caller chooses ``model.eval()`` / ``train()``. ``on_batch(records, tokens)`` after each of
    this rank's batches (a progress display).
    """
    mine = sorted((examples[i] for i in shard_indices(len(examples), rank, world_size)),
                  key=lambda e: len(e.input_ids))  # similar lengths together: less padding
    per_rank = -(-len(examples) // world_size) if lockstep else len(mine)
    loss_sum, count = 0.0, 0
    for start in range(0, per_rank, batch_size):
        chunk = mine[start:start + batch_size]
        inputs = collate(chunk or examples[:1], pad_id, device)
        logits = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits
        if chunk:
            loss_sum += next_token_loss_sum(logits, inputs["labels"]).item()
            count += sum(e.targets for e in chunk)
            if on_batch is not None:
                on_batch(len(chunk), sum(len(e.input_ids) for e in chunk))
    return loss_sum, count
