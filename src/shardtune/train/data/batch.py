"""Each rank's forward passes: the seeded sampler of global batches, and a forward's layout.

The sampler draws *items*: records, or under a preference objective pairs (an item is ``per_item``
consecutive examples of the dataset, records.RecordFormat). A forward takes whole items, right-padded
one sequence a row, or packed (pack.py), in the layout the model's attention wants (train/attention.py):

* ``shardtune``/flash attention: packed rows become one row of records end to end, with their lengths
  (no mask); padded rows need no mask (causal attention never looks ahead, at the padding);
* other attention: packed rows get a 4-D block mask, padded rows the 2-D padding mask.

``Forward.targets`` holds, per position, the token it predicts (the next token's label; IGNORE where
none, so also at each record's end); ``Forward.owners`` which of the forward's sequences that target
belongs to: what the loss head scores and the objectives sum.

Context parallelism (``Layout.context``, --context-parallel N): the N ranks of a group take the same
items (their data-parallel rank's), lay them out as above, and each keeps its piece of every row
(parallel/context_parallel.py): input ids, positions (those of the whole row: restarting per packed
record), targets (pre-shifted, so a target travels with its token) and owners; rows padded to a
multiple of N, the padding never a target. Attention meets the pieces through ``shardtune_cp``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from shardtune.model.attention import NAME, VARLEN
from shardtune.parallel.context_parallel import shared_sum, split_sequence
from shardtune.parallel.mesh import ContextGroup
from shardtune.parallel.ulysses import PieceAttention
from shardtune.runplan import BatchSplit
from shardtune.train.data.pack import block_causal_mask, forwards_per_rank
from shardtune.train.data.records import IGNORE, Example


class Sampler:
    """An endless, seeded stream of global batches; each epoch is a fresh permutation.

    Batch ``step`` depends only on (seed, step), which is what makes resuming exact.
    """

    def __init__(self, dataset_size: int, plan: BatchSplit, seed: int) -> None:
        self.n, self.plan, self.seed = dataset_size, plan, seed
        self._perms: dict[int, list[int]] = {}

    def _perm(self, epoch: int) -> list[int]:
        if epoch not in self._perms:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perms = {epoch: torch.randperm(self.n, generator=g).tolist()}
        return self._perms[epoch]

    def global_batch(self, step: int) -> list[int]:
        start = step * self.plan.batch_size
        return [self._perm((start + i) // self.n)[(start + i) % self.n] for i in range(self.plan.batch_size)]

    def micro_batches(self, step: int, rank: int) -> list[list[int]]:
        """This rank's share of batch ``step``, as its accumulation micro-batches."""
        per_rank = self.plan.batch_size // self.plan.world_size
        mine = self.global_batch(step)[rank * per_rank:(rank + 1) * per_rank]
        m = self.plan.micro_batch_size
        return [mine[i:i + m] for i in range(0, per_rank, m)]


def pad_id(tokenizer) -> int:
    """Padding is always masked, so any id works: pad, else eos, else 0."""
    if tokenizer.pad_token_id is not None:
        return tokenizer.pad_token_id
    return tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0


def collate(examples: list[Example], pad_id: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Right-pad to the longest example; padding is masked and never a target."""
    width = max(len(e.input_ids) for e in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for i, e in enumerate(examples):
        n = len(e.input_ids)
        ids[i, :n] = torch.tensor(e.input_ids)
        labels[i, :n] = torch.tensor(e.labels)
        mask[i, :n] = 1
    return {"input_ids": ids.to(device), "labels": labels.to(device), "attention_mask": mask.to(device)}


@dataclass
class Forward:
    """One forward pass of a rank: whole items, laid out for the model."""

    inputs: dict  # the model's keyword arguments
    targets: torch.Tensor  # (rows, width): the token each position predicts, IGNORE where none
    owners: torch.Tensor  # (rows, width): the forward's sequence each target belongs to, -1 where none
    items: list[int]  # the dataset's items, in forward order: item j holds sequences j·k … j·k + k − 1
    real_tokens: int  # record tokens, not padding
    positions: int  # tokens the model computes, padding included
    sequences: int  # len(items) × per_item
    context: ContextGroup | None = None  # context parallelism: the rows are this rank's pieces
    #: the flat positions of ``targets`` that have a target, None where all do: the only ones the loss head
    #: scores (train/loss_head.py ``score``), found here on the host so that no forward waits on a device to
    #: count them
    scored: torch.Tensor | None = None

    @property
    def share(self) -> float:
        """What this rank counts of a value every rank of its CP group computes whole from per-sequence
        sums (``sequence_sums``): 1/N, so that the group counts it once."""
        return 1.0 / self.context.size if self.context is not None else 1.0


@dataclass
class Layout:
    """How the forwards of one dataset are laid out (``Batcher``'s fixed facts)."""

    examples: Sequence[Example]
    per_item: int  # examples (sequences) per item
    seq_len: int
    pad_id: int
    device: torch.device
    attention: str  # the model's attention implementation (train/attention.py)
    dtype: torch.dtype  # the compute dtype (of a 4-D mask)
    context: ContextGroup | None = None  # context parallelism (size > 1), else None

    def __post_init__(self) -> None:
        if self.context is not None and self.context.size == 1:
            self.context = None
        if self.context is not None and self.attention != NAME:
            raise ValueError(f"context parallelism needs the '{NAME}' attention, not '{self.attention}'")


class Batcher:
    """This rank's forwards of a dataset's items."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout

    def sequences(self, items: Sequence[int]) -> list[Example]:
        k = self.layout.per_item
        return [self.layout.examples[i * k + j] for i in items for j in range(k)]

    def tokens(self, items: Sequence[int]) -> int:
        return sum(len(e.input_ids) for e in self.sequences(items))

    def padded(self, items: list[int]) -> Forward:
        """Each sequence of ``items`` a row, right-padded (no items: one row of one padding token)."""
        lay = self.layout
        rows = self.sequences(items)
        batch = collate(rows or [Example([lay.pad_id], [IGNORE])], lay.pad_id, torch.device("cpu"))
        mask = batch["attention_mask"]
        owners = torch.where(mask.bool(), torch.arange(mask.size(0))[:, None], -1) if rows else -torch.ones_like(mask)
        inputs = {"input_ids": batch["input_ids"].to(lay.device)}
        if lay.attention not in VARLEN:
            inputs["attention_mask"] = mask.to(lay.device)
        return self._forward(inputs, batch["labels"], owners, items)

    def packed(self, rows_of_items: list[list[int]]) -> Forward:
        """Each row's items end to end (their sequences in order), rows right-padded to the longest; under
        a varlen attention all rows as one. No rows: one row of one padding token."""
        lay = self.layout
        rows = [self.sequences(row) for row in rows_of_items]
        if lay.attention in VARLEN:
            rows = [[e for row in rows for e in row]]
        rows = [row for row in rows if row] or [[]]
        width = max(1, max(sum(len(e.input_ids) for e in row) for row in rows))
        shape = (len(rows), width)
        ids = torch.full(shape, lay.pad_id, dtype=torch.long)
        labels = torch.full(shape, IGNORE, dtype=torch.long)
        positions = torch.zeros(shape, dtype=torch.long)
        segments = torch.full(shape, -1, dtype=torch.long)  # sequence number within its row, -1 padding
        owners = torch.full(shape, -1, dtype=torch.long)
        lengths, seq = [], 0
        for r, row in enumerate(rows):
            at = 0
            for s, e in enumerate(row):
                n = len(e.input_ids)
                ids[r, at:at + n] = torch.tensor(e.input_ids)
                labels[r, at + 1:at + n] = torch.tensor(e.labels[1:])  # the first token is no target
                positions[r, at:at + n] = torch.arange(n)
                segments[r, at:at + n] = s
                owners[r, at:at + n] = seq
                lengths.append(n)
                at += n
                seq += 1
        inputs = {"input_ids": ids.to(lay.device), "position_ids": positions.to(lay.device)}
        if lay.attention in VARLEN and lengths:
            # host integers for shardtune's attention (no device read per layer), tensors for flash's kernels
            cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
            inputs.update(shardtune_lengths=tuple(lengths)) if lay.attention == "shardtune" else inputs.update(
                cu_seq_lens_q=cu.to(lay.device), cu_seq_lens_k=cu.to(lay.device), max_length_q=max(lengths),
                max_length_k=max(lengths))
        elif lay.attention not in VARLEN:
            inputs["attention_mask"] = block_causal_mask(segments.to(lay.device), lay.dtype)
        return self._forward(inputs, labels, owners, [i for row in rows_of_items for i in row], segments)

    def _forward(self, inputs: dict, labels: torch.Tensor, owners: torch.Tensor, items: list[int],
                 segments: torch.Tensor | None = None) -> Forward:
        """The forward of whole rows (``segments``: packed rows' record per token, -1 padding; None: a
        record per row), or under context parallelism this rank's piece of them."""
        targets = torch.full_like(labels, IGNORE)
        targets[:, :-1] = labels[:, 1:]
        owned = torch.full_like(owners, -1)
        owned[:, :-1] = owners[:, 1:]
        owned[targets == IGNORE] = -1
        context = self.layout.context
        if context is not None:
            inputs, targets, owned = self._piece(context, inputs, targets, owned, segments)
        has = targets.reshape(-1) != IGNORE
        scored = None if bool(has.all()) else has.nonzero().squeeze(1).to(self.layout.device)
        return Forward(inputs, targets.to(self.layout.device), owned.to(self.layout.device), items,
                       self.tokens(items), targets.numel(), len(items) * self.layout.per_item, context, scored)

    def _piece(self, context: ContextGroup, inputs: dict, targets: torch.Tensor, owned: torch.Tensor,
               segments: torch.Tensor | None) -> tuple[dict, torch.Tensor, torch.Tensor]:
        """This rank's piece of the rows: the model's inputs (positions of the whole rows), targets, owners."""
        ids = inputs["input_ids"]
        positions = inputs.get("position_ids")
        if positions is None:  # unpacked rows: each counts from 0
            positions = torch.arange(ids.size(1), device=ids.device).expand_as(ids)
        layout, piece = split_sequence(
            {"input_ids": ids, "position_ids": positions, "targets": targets, "owners": owned},
            {"input_ids": self.layout.pad_id, "position_ids": 0, "targets": IGNORE, "owners": -1},
            context.size, context.rank, segments)
        inputs = {"input_ids": piece["input_ids"], "position_ids": piece["position_ids"],
                  "shardtune_cp": PieceAttention(layout, context.group)}
        return inputs, piece["targets"], piece["owners"]

    def data_rank(self, rank: int, world_size: int) -> tuple[int, int]:
        """(which share of the items rank ``rank`` of ``world_size`` takes, of how many shares): its own,
        or under context parallelism its data-parallel group's (the ranks of a CP group share items)."""
        c = self.layout.context
        return (c.data_rank, c.data_ranks) if c is not None else (rank, world_size)

    def step(self, batch: list[int], split: BatchSplit, rank: int, packing: bool) -> list[Forward]:
        """Rank ``rank``'s forwards of global batch ``batch`` (item indices): its share (its data-parallel
        group's, ``split`` being over those) packed into rows of up to per_item × --seq-len tokens, or its
        micro-batches padded; every rank runs as many forwards."""
        rank, _ = self.data_rank(rank, split.world_size)
        per_rank = split.batch_size // split.world_size
        shares = [batch[r * per_rank:(r + 1) * per_rank] for r in range(split.world_size)]
        if packing:
            capacity = self.layout.per_item * self.layout.seq_len
            mine = forwards_per_rank(shares, lambda i: self.tokens([i]), capacity, split.micro_batch_size)[rank]
            return [self.packed(rows) for rows in mine]
        mine, m = shares[rank], split.micro_batch_size
        return [self.padded(mine[i:i + m]) for i in range(0, per_rank, m)]

    def lockstep(self, n_items: int, micro: int, rank: int, world_size: int, together: bool = True
                 ) -> Iterator[Forward]:
        """Every world_size-th of ``n_items`` items, longest first (less padding), ``micro`` a forward.
        ``together`` (a sharded model): a rank out of items gets empty forwards, so that it still joins
        every collective (each rank runs as many forwards as the rank with the most items). The ranks of a
        context-parallel group take the same items (``data_rank``)."""
        rank, world_size = self.data_rank(rank, world_size)
        mine = sorted(range(rank, n_items, world_size), key=lambda i: -self.tokens([i]))
        per_rank = -(-n_items // world_size) if together else len(mine)
        for start in range(0, per_rank, micro):
            yield self.padded(mine[start:start + micro])


def sequence_sums(values: torch.Tensor, fwd: Forward) -> torch.Tensor:
    """Per sequence of ``fwd`` (in forward order), the sum of ``values`` (rows, width) over its targets
    (under context parallelism over every piece of it: the whole sequence's, on every rank of the group)."""
    n = fwd.sequences
    index = torch.where(fwd.owners >= 0, fwd.owners, n).flatten()
    sums = values.new_zeros(n + 1).index_add(0, index, values.flatten())[:n]
    # Context parallelism: a sequence's targets lie in pieces on every rank of the group; each rank then
    # holds the whole sums, and counts what it computes from them by ``fwd.share`` (``shared_sum``).
    return shared_sum(sums, fwd.context.group) if fwd.context is not None else sums
