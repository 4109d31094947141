"""Where one training step's time goes: torch.profiler over a step of shardtune on 2 ranks.

    flock /tmp/bigrun.lock .venv/bin/python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        bench/step_profile.py --strategy fsdp2 --fsdp-unit part --seq-len 128

Uses the 1.1B random Llama-shape checkpoint and the fixed-length data of bench/speed.py (made under
bench/.cache). One warm-up step, then one profiled step; rank 0 prints the operators with the most
self time, the number of collectives and the time spent in them, and writes
bench/results/profile-<strategy>-<unit>-<micro>x<seq>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", default="fsdp2")
    parser.add_argument("--fsdp-unit", default="part")
    parser.add_argument("--micro-batch-size", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--cache", type=Path, default=HERE / ".cache")
    args = parser.parse_args()
    torch.set_num_threads(1)  # as bench/peers.py: 2 ranks on 2 cores

    from shardtune.config import build_config
    from shardtune.runtime import distributed
    from shardtune.runtime.memory import MemoryMonitor, tune_malloc
    from shardtune.train.recipe import prepare, train_step

    tune_malloc()
    world = int(os.environ["WORLD_SIZE"])
    cfg = build_config({"model": str(args.cache / "llama-1.1b"), "data": str(args.cache / f"data-{args.seq_len}.jsonl"),
                        "out": "/tmp/step-profile", "strategy": args.strategy, "fsdp-unit": args.fsdp_unit,
                        "batch-size": world * args.micro_batch_size, "micro-batch-size": args.micro_batch_size,
                        "seq-len": args.seq_len, "lora-targets": "q_proj,v_proj", "steps": 3})
    worker = distributed.init_worker()
    job = prepare(cfg, worker, MemoryMonitor(worker.device))
    params = list(job.strategy.trainable(job.model).values())

    def step(i: int) -> float:
        started = time.perf_counter()
        train_step(job, i)
        for p in params:
            p.grad = None
        return time.perf_counter() - started

    warm = step(0)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        seconds = step(1)
    events = prof.key_averages()
    top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:20]
    rows = [{"op": e.key, "calls": e.count, "self_s": round(e.self_cpu_time_total / 1e6, 3),
             "total_s": round(e.cpu_time_total / 1e6, 3)} for e in top]
    comm = [e for e in events if any(k in e.key for k in ("broadcast", "all_gather", "reduce_scatter", "allreduce",
                                                          "all_reduce", "gloo", "wait"))]
    result = {"strategy": args.strategy, "fsdp_unit": args.fsdp_unit, "micro": args.micro_batch_size,
              "seq_len": args.seq_len, "warmup_step_s": round(warm, 3), "profiled_step_s": round(seconds, 3),
              "top_self": rows,
              "collectives": [{"op": e.key, "calls": e.count, "self_s": round(e.self_cpu_time_total / 1e6, 3),
                               "total_s": round(e.cpu_time_total / 1e6, 3)} for e in comm]}
    if worker.is_main:
        print(f"step {seconds:.2f} s (warm-up {warm:.2f} s)")
        for r in rows:
            print(f"  {r['op'][:60]:<60} {r['calls']:6d} self {r['self_s']:7.3f} s  total {r['total_s']:7.3f} s")
        print("collectives:")
        for r in result["collectives"]:
            print(f"  {r['op'][:60]:<60} {r['calls']:6d} self {r['self_s']:7.3f} s  total {r['total_s']:7.3f} s")
        out = HERE / "results" / (f"profile-{args.strategy}-{args.fsdp_unit}-{args.micro_batch_size}x"
                                  f"{args.seq_len}.json")
        out.write_text(json.dumps(result, indent=2))
    distributed.teardown()
    distributed.exit_worker(0)


if __name__ == "__main__":
    main()
