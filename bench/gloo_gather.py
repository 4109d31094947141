"""Gloo's all-gather against one broadcast per owner, under each allocator setting a CPU worker may have.

    .venv/bin/python bench/gloo_gather.py

Two processes on this host, a gloo group: every rank's part (0.5, 2, 8 and 56 MB of fp32, the last one rank's
rows of SmolLM2-135M's tied 49,152 x 576 table) gathered into one tensor, 6 times each, two ways:
``all_gather_single`` (what parallel/exchange.py ``everyones`` uses: exchanged projections' inputs, scoring's
tokens) and one in-place ``broadcast`` per owner (what FSDP2's gathers use on gloo: gloo_comms.BroadcastAllGather).
Each under glibc's defaults, shardtune's 128 KiB mmap threshold, and that threshold with
``GLIBC_TUNABLES=glibc.malloc.hugetlb=1`` (what its launcher gives CPU workers: runtime/cpu_tuning.py). Gloo's
all-gather receives into a fresh flat tensor and copies it out, so its cost follows the allocator's. Prints the
median milliseconds (and the first call's) and writes bench/results/gloo-gather.json. CPU only: on GPUs NCCL
gathers into the output.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from record import run_record
from shardtune.runtime.cpu_tuning import MMAP_THRESHOLD, worker_malloc_env
from shardtune.runtime.workers import free_port

HERE = Path(__file__).resolve().parent
SIZES_MB = (0.5, 2, 8, 56)
REPEAT = 6
CHILD = """
import json, os, sys, time, torch
import torch.distributed as dist
torch.set_num_threads(1)
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
out = {}
for mb in json.loads(sys.argv[1]):
    part = torch.randn(int(mb * 2**20 / 4))
    for way in ("all_gather", "broadcasts"):
        times = []
        for _ in range(int(sys.argv[2])):
            dist.barrier()
            started = time.perf_counter()
            every = part.new_empty(world * part.numel())
            if way == "all_gather":
                dist.all_gather_single(every, part)
            else:
                for owner in range(world):
                    view = every[owner * part.numel():(owner + 1) * part.numel()]
                    if owner == rank:
                        view.copy_(part)
                    dist.broadcast(view, src=owner)
            times.append((time.perf_counter() - started) * 1000)
            del every
        out[f"{mb} {way}"] = times
if rank == 0:
    print(json.dumps(out))
dist.destroy_process_group()
"""


def run(extra: dict[str, str]) -> dict[str, list[float]]:
    """The child on two ranks with ``extra`` in their environment (read as each process starts)."""
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "MALLOC_MMAP_THRESHOLD_")}
    env.update(extra, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2", OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, json.dumps(SIZES_MB), str(REPEAT)],
                              env={**env, "RANK": str(r)}, stdout=subprocess.PIPE, text=True) for r in range(2)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"a rank failed: {[p.returncode for p in procs]}")
    return json.loads(outs[0].strip().splitlines()[-1])


def main() -> None:
    settings = {"glibc defaults": {},
                "mmap threshold": {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD)},
                # the huge-page setting exactly as shardtune's launcher gives it to CPU workers
                "mmap threshold + huge pages": {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD),
                                                **worker_malloc_env("cpu", {})}}
    rows = []
    for name, extra in settings.items():
        for key, times in run(extra).items():
            mb, way = key.split()
            rows.append({"allocator": name, "mb_per_rank": float(mb), "way": way, "first_ms": round(times[0], 2),
                         "median_ms": round(sorted(times)[len(times) // 2], 2)})
    print(f"{'allocator':<28} {'MB/rank':>7} {'way':<11} {'median ms':>10} {'first ms':>9}")
    for r in rows:
        print(f"{r['allocator']:<28} {r['mb_per_rank']:7g} {r['way']:<11} {r['median_ms']:10.2f} {r['first_ms']:9.2f}")
    print("\nall-gather / broadcasts (median):")
    for name in settings:
        ratios = []
        for mb in SIZES_MB:
            pair = {r["way"]: r["median_ms"] for r in rows if r["allocator"] == name and r["mb_per_rank"] == mb}
            ratios.append(f"{mb:g} MB {pair['all_gather'] / pair['broadcasts']:.2f}")
        print(f"  {name:<28} " + ", ".join(ratios))
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    result = {"rows": rows, "repeat": REPEAT, "transparent_hugepage": thp.read_text().strip() if thp.exists() else None,
              **run_record()}
    (HERE / "results" / "gloo-gather.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
