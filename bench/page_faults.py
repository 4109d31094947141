"""What a fresh buffer costs against a reused one, with and without glibc's huge pages.

    .venv/bin/python bench/page_faults.py

Copies a 46 MB fp32 tensor (the shape of a 1.1B MLP weight's gathered unit) 40 times into a freshly
allocated buffer and 40 times into one reused buffer, in a child process per allocator setting:
shardtune's 128 KiB mmap threshold alone, and with ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1`` (what
its launcher sets for CPU workers). Prints GB/s and writes bench/results/page-faults.json.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from record import run_record
from shardtune.runtime.cpu_tuning import MMAP_THRESHOLD, worker_malloc_env

HERE = Path(__file__).resolve().parent
CHILD = """
import json, time, torch
torch.set_num_threads(1)
src = torch.randn(2, 5632 * 2048 // 2)
def rate(fresh):
    dst = torch.empty_like(src)
    started = time.perf_counter()
    for _ in range(40):
        if fresh:
            dst = torch.empty_like(src)
        dst.copy_(src)
    return 40 * src.numel() * 4 / (time.perf_counter() - started) / 1e9
print(json.dumps({"fresh_gb_s": rate(True), "reused_gb_s": rate(False)}))
"""


def main() -> None:
    rows = {}
    # the huge-page setting exactly as shardtune's launcher gives it to CPU workers
    for name, extra in (("mmap threshold", {}), ("mmap threshold + huge pages", worker_malloc_env("cpu", {}))):
        env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
        env.update({"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD), **extra})
        out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, check=True)
        rows[name] = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"{'allocator':<30} {'fresh GB/s':>10} {'reused GB/s':>12}")
    for name, r in rows.items():
        print(f"{name:<30} {r['fresh_gb_s']:10.2f} {r['reused_gb_s']:12.2f}")
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    result = {"rows": rows, "transparent_hugepage": thp.read_text().strip() if thp.exists() else None, **run_record()}
    (HERE / "results" / "page-faults.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
