"""``--packing``: several records share one sequence of up to ``--seq-len`` tokens.

Short records padded to the longest one in a micro-batch spend most of the compute on padding.
Packed, each rank's share of the global batch is laid end to end in as few sequences ("rows") as
first-fit-decreasing finds, its records then spread evenly over those rows (a forward is as wide as
its longest row), and each forward takes up to ``--micro-batch-size`` rows. An item of several
sequences (a preference pair) stays whole in one row, which then holds up to that many × --seq-len
tokens. Within a row no token sees another record's tokens and positions restart at every record:

* attention implementations that take the records' lengths (``shardtune``'s own, train/attention.py,
  and flash-attention on GPUs) get all rows as one row without padding, and no mask;
* other attention paths (``eager``, or models with attention code of their own) get a block-diagonal
  causal 4-D mask, which transformers passes through unchanged — rows × width² elements;
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

import torch
from torch import nn

from shardtune.config import ConfigError
from shardtune.model.attention import MASKED, VARLEN, implementation


def check_packing(model: nn.Module) -> None:
    """Refuse packing where records would see each other or keep counting positions: an attention
    path that takes neither a 4-D mask nor sequence lengths, or a model without ``position_ids``."""
    config = next(m.config for m in model.modules() if hasattr(m, "config") and hasattr(m.config, "model_type"))
    impl = implementation(model)
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
