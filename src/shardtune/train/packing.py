"""``--packing``: several records share one sequence of up to ``--seq-len`` tokens.

Short records padded to the longest one in a micro-batch spend most of the compute on padding.
Packed, each rank's share of the global batch is laid end to end in as few sequences ("rows") as
first-fit-decreasing finds, its records then spread evenly over those rows (a forward is as wide as
its longest row), and each forward takes up to ``--micro-batch-size`` rows. Within a row
no token sees another record's tokens and positions restart at every record:

* ``sdpa`` and ``eager`` attention get a block-diagonal causal mask, 4-D, which transformers passes
  through unchanged (its own detection of packed rows from ``position_ids`` works only without a
  mask and reads the device every forward);
* ``flash_attention_2``/``_3`` (GPU) get no mask and the rows' cumulative lengths (``cu_seq_lens_*``),
  which make them run one variable-length attention over the records;
* the position ids restart at 0 per record, also for models with learned absolute positions
  (GPT-2, OPT), which take them as an input too.

The loss is unchanged: the first token of each record is never a target (it would be predicted
from the previous record), exactly as without packing, so per-token losses and their sum equal the
padded ones. Every rank knows every record's length (the data is tokenized everywhere), so each rank
computes every rank's packing and all run the same number of forwards, the shorter ones padded
with an empty row: under FSDP every forward is a collective.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from shardtune.config import ConfigError
from shardtune.train.data import IGNORE, BatchSplit, Example

#: attention implementations that packing supports, and how they are told where records end
MASKED = ("sdpa", "eager")
VARLEN = ("flash_attention_2", "flash_attention_3")


def attention_of(model: nn.Module) -> str:
    """The attention implementation the (peft, FSDP or DDP wrapped) transformers model runs."""
    config = next(m.config for m in model.modules() if hasattr(m, "config") and hasattr(m.config, "model_type"))
    return getattr(config, "_attn_implementation", None) or "eager"


def check_packing(model: nn.Module) -> None:
    """Refuse packing where records would see each other or keep counting positions: an attention
    path that takes neither a 4-D mask nor sequence lengths, or a model without ``position_ids``."""
    config = next(m.config for m in model.modules() if hasattr(m, "config") and hasattr(m.config, "model_type"))
    impl = attention_of(model)
    if impl not in MASKED + VARLEN:
        raise ConfigError(f"option 'packing': the model ({config.model_type}) uses attention '{impl}', which "
                          f"cannot keep packed records apart; supported: {', '.join(MASKED + VARLEN)}")
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if "position_ids" not in inspect.signature(base.forward).parameters:
        raise ConfigError(f"option 'packing': the model ({config.model_type}) takes no position_ids, so "
                          f"positions could not restart at each packed record; train it without --packing")


def pack_rows(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Indices into ``lengths`` grouped into rows of at most ``capacity`` tokens: as few rows as first
    fit decreasing finds, then the records spread evenly over them.

    A forward pads its rows to the longest, and first fit leaves the last row nearly empty (8 records
    of ~130 tokens: rows of 510, 505 and 30, padded to 3 x 510). Balanced (longest record first onto
    the row holding the fewest tokens), the same rows are ~350 wide. Kept only when no row exceeds
    ``capacity`` and the widest row is narrower than first fit's. Deterministic: ties go to the lower
    index; a row's records are in decreasing length, and rows longest first.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    rows: list[list[int]] = []
    free: list[int] = []
    for i in order:
        if lengths[i] > capacity:
            raise ValueError(f"a record of {lengths[i]} tokens does not fit in --seq-len {capacity}")
        for r, room in enumerate(free):
            if lengths[i] <= room:
                rows[r].append(i)
                free[r] -= lengths[i]
                break
        else:
            rows.append([i])
            free.append(capacity - lengths[i])
    balanced: list[list[int]] = [[] for _ in rows]
    used = [0] * len(rows)
    for i in order:
        r = min(range(len(rows)), key=lambda r: (used[r], r))
        balanced[r].append(i)
        used[r] += lengths[i]
    if rows and max(used) <= capacity and max(used) < capacity - min(free):
        rows = balanced
    return sorted(rows, key=lambda row: -sum(lengths[i] for i in row))


def forwards_per_rank(shares: Sequence[Sequence[int]], length: Callable[[int], int], capacity: int,
                      rows_per_forward: int) -> list[list[list[list[int]]]]:
    """For each rank's share (record indices), its forwards, each a list of rows of record indices;
    ``length(i)``: record ``i``'s tokens.

    Every rank gets as many forwards as the rank that needs the most; the others end with empty ones.
    """
    out = []
    for share in shares:
        rows = [[share[i] for i in row] for row in pack_rows([length(i) for i in share], capacity)]
        out.append([rows[i:i + rows_per_forward] for i in range(0, len(rows), rows_per_forward)])
    most = max(len(f) for f in out)
    return [f + [[]] * (most - len(f)) for f in out]


@dataclass
class PackedBatch:
    """One forward's packed rows, and what the model needs to keep the records apart."""

    input_ids: torch.Tensor  # (rows, width)
    labels: torch.Tensor  # (rows, width), IGNORE on padding and on each record's first token
    position_ids: torch.Tensor  # (rows, width), restarting at 0 per record
    segments: torch.Tensor  # (rows, width): record number within the row, -1 on padding
    real_tokens: int

    @property
    def positions(self) -> int:
        return self.input_ids.numel()

    def model_inputs(self, attn_implementation: str | None, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Keyword arguments for the model's forward, for its attention implementation."""
        inputs: dict = {"input_ids": self.input_ids, "position_ids": self.position_ids}
        if (attn_implementation or "eager") in VARLEN:
            # One sequence of all real tokens' rows back to back: flash's varlen layout.
            lengths = [n for row in self._record_lengths() for n in row]
            cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32,
                              device=self.input_ids.device)
            inputs.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(lengths), max_length_k=max(lengths))
        else:
            inputs["attention_mask"] = block_causal_mask(self.segments, dtype)
        return inputs

    def _record_lengths(self) -> list[list[int]]:
        out = []
        for row in self.segments.tolist():
            counts: dict[int, int] = {}
            for s in row:
                counts[s] = counts.get(s, 0) + 1
            out.append([counts[s] for s in sorted(counts)])  # padding (-1) forms a segment of its own
        return out


def block_causal_mask(segments: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Additive 4-D mask (rows, 1, width, width): a token sees earlier tokens of its own record only.

    A padding token sees only itself, so that no attention row is empty (an all-masked row gives
    NaN, and NaN times a zero gradient is still NaN in the weights' gradient).
    """
    width = segments.size(1)
    causal = torch.ones(width, width, dtype=torch.bool, device=segments.device).tril()
    same = segments.unsqueeze(2) == segments.unsqueeze(1)
    pad = segments.eq(-1)
    allowed = (same & causal & ~pad.unsqueeze(1)) | torch.eye(width, dtype=torch.bool, device=segments.device)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=segments.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask.unsqueeze(1)


def collate_packed(rows: list[list[Example]], pad_id: int, device: torch.device, one_row: bool = False) -> PackedBatch:
    """Lay each row's records end to end, right-padded to the longest row (an empty forward: one
    padding token without any target, so that the rank still joins every collective). ``one_row``:
    all records in a single row without padding, the layout of variable-length (flash) attention."""
    rows = [[e for row in rows for e in row]] if one_row else rows
    rows = rows or [[]]
    width = max(1, max(sum(len(e.input_ids) for e in row) for row in rows))
    shape = (len(rows), width)
    ids = torch.full(shape, pad_id, dtype=torch.long)
    labels = torch.full(shape, IGNORE, dtype=torch.long)
    positions = torch.zeros(shape, dtype=torch.long)
    segments = torch.full(shape, -1, dtype=torch.long)
    real = 0
    for r, row in enumerate(rows):
        at = 0
        for s, e in enumerate(row):
            n = len(e.input_ids)
            ids[r, at:at + n] = torch.tensor(e.input_ids)
            labels[r, at + 1:at + n] = torch.tensor(e.labels[1:])  # the first token is no target
            positions[r, at:at + n] = torch.arange(n)
            segments[r, at:at + n] = s
            at += n
        real += at
    return PackedBatch(ids.to(device), labels.to(device), positions.to(device), segments.to(device), real)


def packed_forwards(batch: Sequence[int], examples: Sequence[Example], plan: BatchSplit, seq_len: int, rank: int,
                    pad_id: int, device: torch.device, one_row: bool) -> list[PackedBatch]:
    """This rank's forwards of global batch ``batch`` (record indices), packed."""
    per_rank = plan.batch_size // plan.world_size
    shares = [batch[r * per_rank:(r + 1) * per_rank] for r in range(plan.world_size)]
    mine = forwards_per_rank(shares, lambda i: len(examples[i].input_ids), seq_len, plan.micro_batch_size)[rank]
    return [collate_packed([[examples[i] for i in row] for row in rows], pad_id, device, one_row) for rows in mine]
