"""The reference model's values, and ``--precompute-reference``: every pair's computed once, before the first step.

Each rank computes every world_size-th pair (the sharded model, all ranks in every forward), the ranks
exchange their values, and rank 0 stores the table beside the token cache as ``ref-KEY.pt``. The key
covers what the values depend on: the tokenized data (the token cache's own key), the model's files,
the dtype, the quantization and the initial adapter. A later run with the same key, ``--resume``
included, reads the table instead of computing it again. Steps then skip the reference forward.

With ``--init-adapter`` the reference is the model training starts from (base + that adapter): the
table is computed with the adapter on, before the first step, so no frozen second copy of the adapter
is needed.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
from pathlib import Path

import torch
from torch import nn

from shardtune.runtime import distributed
from shardtune.runtime.compat import adapters_disabled
from shardtune.runtime.progress import progress
from shardtune.train.data.batch import Batcher, Forward
from shardtune.train.loss_head import score
from shardtune.train.objectives import Objective

log = logging.getLogger("shardtune")


def _files_identity(path: str | Path | None) -> list[str]:
    if not path:
        return []
    p = Path(path)
    files = sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p] if p.is_file() else []
    return [f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files if not f.name.startswith(".")]


def reference_key(data_key: str, model_path: str, dtype: str, quantize: str, init_adapter: str | None) -> str:
    parts = [data_key, str(Path(model_path).resolve()), *_files_identity(model_path), dtype, quantize,
             str(init_adapter), *_files_identity(init_adapter), "1"]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:24]


class Reference:
    """The reference model's values (``Objective.reference_of``) of a forward's items: read from a
    precomputed table, or computed by a forward of the policy's own sharded base with every adapter layer
    switched off (``compat.adapters_disabled``; with ``adapters_on``, the model as it is: the initial
    adapter before the first step), under ``no_grad``: no second model, no saved activations. Under FSDP
    it is a collective like any forward, so every rank runs it for every forward, empty ones included."""

    def __init__(self, objective: Objective, table: torch.Tensor | None = None, adapters_on: bool = False) -> None:
        self.objective, self.table, self.adapters_on = objective, table, adapters_on

    @torch.no_grad()
    def values(self, model: nn.Module, fwd: Forward) -> torch.Tensor:
        if self.table is not None:
            return self.table[fwd.items].to(fwd.targets.device)
        with contextlib.nullcontext() if self.adapters_on else adapters_disabled(model):
            scores = score(model, fwd.inputs, fwd.targets, scored=fwd.scored)
        return self.objective.reference_of(scores, fwd)


@torch.no_grad()
def compute_reference(model: nn.Module, reference: Reference, batcher: Batcher, n_items: int, micro: int,
                      rank: int, world_size: int) -> torch.Tensor:
    """The reference values of every item, on CPU, the same table on every rank: each rank computes every
    world_size-th item, and the ranks exchange their shares."""
    was_training = model.training
    model.eval()
    mine: dict[int, torch.Tensor] = {}
    per_rank = -(-n_items // world_size)
    # rank 0 counts its own share: every rank runs as many forwards, so its bar is the run's
    with progress("reference log-probs", per_rank * world_size, unit="pair", enabled=rank == 0) as bar:
        for fwd in batcher.lockstep(n_items, micro, rank, world_size):
            values = reference.values(model, fwd).cpu()
            mine.update(zip(fwd.items, values[:len(fwd.items)]))
            bar.advance(max(1, len(fwd.items)) * world_size, tokens=fwd.real_tokens * world_size)
    model.train(was_training)
    shares = distributed.all_gather_object(mine) if world_size > 1 else [mine]
    found = {i: v for share in shares for i, v in share.items()}
    return torch.stack([found[i] for i in range(n_items)])


def precomputed_reference(cache_dir: Path, key: str, compute, is_main: bool, world_size: int,
                          what: str) -> torch.Tensor:
    """The stored table for ``key``, or ``compute()``'s, stored by rank 0 (atomically: a crash leaves none).
    Computing is a collective: the ranks decide together, so that all compute or none does."""
    file = cache_dir / f"ref-{key}.pt"
    found = file.is_file()
    if world_size > 1:
        found = all(distributed.all_gather_object(found))
    if found:
        try:
            table = torch.load(file, weights_only=True)
            log.info("reference log-probs of %s: read from %s", what, file)
            return table
        except Exception as err:  # a torn or foreign file: compute it again
            log.warning("reference log-probs in %s are unreadable (%s); computing them again", file, err)
    table = compute()
    if is_main:
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = file.with_name(f".{file.name}.tmp-{os.getpid()}")
        torch.save(table, tmp)
        os.replace(tmp, file)
        log.info("reference log-probs of %s: %d pairs computed, stored in %s", what, len(table), file)
    return table
