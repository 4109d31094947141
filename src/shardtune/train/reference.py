"""``--precompute-reference``: every pair's reference log-probs computed once, before the first step.

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

import hashlib
import logging
import os
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from shardtune.runtime import distributed
from shardtune.runtime.progress import progress
from shardtune.train.data import Example
from shardtune.train.preference import lockstep_forwards, my_pairs, reference_logps

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


@torch.no_grad()
def compute_reference(model: nn.Module, examples: Sequence[Example], micro: int, pad_id: int, device: torch.device,
                      rank: int, world_size: int, adapters_on: bool) -> torch.Tensor:
    """(pairs, 2) reference log-probs of every pair, on CPU, the same table on every rank."""
    n = len(examples) // 2
    per_rank = my_pairs(n, rank, world_size)[1]
    values = torch.zeros(per_rank, 2, dtype=torch.float32)
    was_training = model.training
    model.eval()
    # rank 0 counts its own share: every rank runs as many forwards, so its bar is the run's
    with progress("reference log-probs", per_rank * world_size, unit="pair", enabled=rank == 0) as bar:
        for start, chunk, fwd in lockstep_forwards(examples, micro, pad_id, device, rank, world_size):
            logps = reference_logps(model, fwd, adapters_on=adapters_on).cpu()
            values[start:start + len(chunk)] = logps[:len(chunk)]
            bar.advance(len(chunk) * world_size, tokens=fwd.real_tokens * world_size)
    model.train(was_training)
    shares = distributed.all_gather_object(values) if world_size > 1 else [values]
    table = torch.zeros(n, 2, dtype=torch.float32)
    for r, share in enumerate(shares):
        table[r::world_size] = share[:len(range(r, n, world_size))]
    return table


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
