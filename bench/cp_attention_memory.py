"""Context-parallel attention's memory per rank against the sequence length (CPU, fp32, gloo).

For each length, one forward and backward of the attention of one record of that length with the
SmolLM2-135M head shape (9 query heads, 3 key/value heads of 64), on 1 process (the per-record SDPA
alone) and on N processes (``ulysses_attention``, each rank holding 1/N of the sequence), on the
busiest rank: the peak resident memory above what the process held once q, k, v and the upstream
gradient were made (the transient cost of one layer's attention), and the tensors autograd saves
for backward (what every layer keeps until its backward: the term that multiplies by the layers).
Both should grow linearly with the length (no length x length score matrix anywhere); the saved
tensors should divide by about N.

    python bench/cp_attention_memory.py [--lengths 2048,4096,8192,16384] [--ranks 1,2]

Writes bench/results/cp-attention-memory.json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from record import run_record  # noqa: E402

HEADS, KV_HEADS, DIM = 9, 3, 64


def _rank(rank: int, size: int, length: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from shardtune.parallel.context_parallel import local_piece, split_sequence
    from shardtune.parallel.ulysses import record_attention, ulysses_attention
    from shardtune.runtime.cpu_tuning import tune_malloc

    torch.set_num_threads(1)
    tune_malloc()  # as shardtune's workers do: freed blocks go back to the system at once
    if size > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=size)

    def inputs(length: int) -> tuple:
        layout, _ = split_sequence({"ids": torch.zeros(1, length)}, {"ids": 0}, size, rank)
        g = torch.Generator().manual_seed(0)
        q, k, v = (local_piece(torch.randn(1, h, length, DIM, generator=g), layout, 2).clone().requires_grad_()
                   for h in (HEADS, KV_HEADS, KV_HEADS))
        return layout, q, k, v, torch.randn(q.shape, generator=g)

    def attention(layout, q, k, v) -> torch.Tensor:
        return ulysses_attention(q, k, v, layout) if size > 1 else record_attention(q, k, v, layout.bounds)

    layout, q, k, v, up = inputs(64)  # warm up: first-call costs (gloo's buffers, kernels) are no term
    (attention(layout, q, k, v) * up).sum().backward()
    layout, q, k, v, up = inputs(length)
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        o = attention(layout, q, k, v)
    (o * up).sum().backward()
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base
    q_mib = q.numel() * 4 / 2**20
    Path(out, f"{rank}.json").write_text(json.dumps({"peak_mib": peak / 1024, "q_mib": q_mib, "seconds": seconds,
                                                     "saved_mib": sum(saved.values()) / 2**20}))
    if size > 1:
        dist.destroy_process_group()


def measure(size: int, length: int) -> dict:
    from shardtune.runtime.workers import free_port

    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_rank, args=(size, length, free_port(), out), nprocs=size, start_method="spawn")
        ranks = [json.loads(Path(out, f"{r}.json").read_text()) for r in range(size)]
    peak = max(r["peak_mib"] for r in ranks)
    return {"ranks": size, "length": length, "peak_mib": round(peak, 1),
            "saved_for_backward_mib": round(max(r["saved_mib"] for r in ranks), 1),
            "q_piece_mib": round(ranks[0]["q_mib"], 2), "peak_over_q_piece": round(peak / ranks[0]["q_mib"], 2),
            "seconds": round(max(r["seconds"] for r in ranks), 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="2048,4096,8192,16384")
    parser.add_argument("--ranks", default="1,2")
    args = parser.parse_args()
    rows = []
    for size in map(int, args.ranks.split(",")):
        for length in map(int, args.lengths.split(",")):
            rows.append(measure(size, length))
            print(rows[-1], flush=True)
    result = {"shape": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": DIM, "dtype": "float32", "records": 1},
              "rows": rows, **run_record()}
    (HERE / "results" / "cp-attention-memory.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
