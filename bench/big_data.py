"""A million-record dataset: memory and time to the first step, tokenized once (cold) and from the cache (warm).

    .venv/bin/python bench/big_data.py                    # 1,000,000 records, 2 ranks
    .venv/bin/python bench/big_data.py --records 200000   # quicker

Makes (once, under --cache) a JSONL file of short instruction records (lengths 20..200 characters;
the tiny model's tokenizer is byte-level: one token a character) and the tiny random Llama, then
runs ``shardtune finetune`` twice with a fresh token cache ($SHARDTUNE_CACHE): the first run's
preflight tokenizes every record once into flat int32 arrays, which the workers memory-map; the
second finds them cached. For each run: seconds from the command's start to the first optimizer
step (metrics.jsonl's first line), the launching process's peak RSS (preflight tokenizes there),
each worker's peak (summary.json: RssAnon + RssShmem, load and train phases) and the cache file's size.
Writes bench/results/big-data.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import torch

from fake_model import make_checkpoint
from record import run_record

HERE = Path(__file__).resolve().parent


def make_records(path: Path, n: int, seed: int = 0) -> Path:
    if path.is_file():
        return path
    words = ["red", "blue", "cat", "dog", "sun", "moon", "tree", "sea", "rock", "bird", "river", "stone"]
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(4, 40, (n,), generator=g).tolist()
    picks = torch.randint(0, len(words), (sum(lengths),), generator=g).tolist()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as f:
        at = 0
        for i, k in enumerate(lengths):
            text = [words[j] for j in picks[at:at + k]]
            at += k
            cut = max(1, k // 3)
            f.write(json.dumps({"instruction": f"{i}: " + " ".join(text[:cut]), "output": " ".join(text[cut:])}) + "\n")
    tmp.replace(path)
    return path


def run(model: Path, data: Path, cache: Path, out: Path, nproc: int) -> dict:
    env = {**os.environ, "SHARDTUNE_CACHE": str(cache)}
    cmd = [sys.executable, "-m", "shardtune", "finetune", "--model", str(model), "--data", str(data),
           "--out", str(out), "--nproc", str(nproc), "--steps", "2", "--batch-size", str(2 * nproc),
           "--seq-len", "128", "--lora-r", "8", "--dtype", "fp32"]
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    launcher = psutil.Process(proc.pid)
    peak, first_step = 0, None
    metrics = out / "metrics.jsonl"
    while proc.poll() is None:
        try:
            peak = max(peak, launcher.memory_info().rss)
        except psutil.NoSuchProcess:
            break
        if first_step is None and metrics.is_file() and metrics.stat().st_size:
            first_step = time.perf_counter() - started
        time.sleep(0.05)
    output = proc.communicate()[0]
    if proc.returncode:
        raise SystemExit(f"shardtune finetune failed ({proc.returncode}):\n{output[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    files = list((cache / "tokenized").glob("*"))
    return {"seconds_to_first_step": round(first_step or float("nan"), 1),
            "wall_seconds": round(time.perf_counter() - started, 1),
            "launcher_peak_mb": round(peak / 2**20),
            "worker_load_peak_mb": [round(v) for v in summary["load_peak_mb"]],
            "worker_train_peak_mb": [round(v) for v in summary["train_peak_mb"]],
            "cache_mb": round(sum(f.stat().st_size for f in files) / 2**20, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--cache", type=Path, default=HERE / ".cache")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "big-data.json")
    args = parser.parse_args()
    model = make_checkpoint("tiny", args.cache)
    started = time.perf_counter()
    data = make_records(args.cache / f"records-{args.records}.jsonl", args.records)
    print(f"data: {data} ({data.stat().st_size / 2**20:.0f} MB, made in {time.perf_counter() - started:.0f} s)",
          file=sys.stderr)
    rows = {}
    with tempfile.TemporaryDirectory(prefix="shardtune-bigdata-") as tmp:
        for name in ("cold", "warm"):  # the same token cache: the second run finds the first run's
            print(f"running {name} ...", file=sys.stderr, flush=True)
            rows[name] = run(model, data, Path(tmp) / "cache", Path(tmp) / name, args.nproc)
    head = f"{'run':<6} {'to 1st step s':>13} {'launcher MB':>11} {'worker load MB':>15} {'worker train MB':>16} " \
           f"{'cache MB':>9}"
    lines = [head, "-" * len(head)]
    for name, r in rows.items():
        lines.append(f"{name:<6} {r['seconds_to_first_step']:13.1f} {r['launcher_peak_mb']:11d} "
                     f"{'/'.join(map(str, r['worker_load_peak_mb'])):>15} "
                     f"{'/'.join(map(str, r['worker_train_peak_mb'])):>16} {r['cache_mb']:9.1f}")
    report = "\n".join(lines)
    print(f"{args.records} records ({data.stat().st_size / 2**20:.0f} MB JSONL), {args.nproc} ranks, tiny Llama\n"
          + report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"records": args.records, "jsonl_mb": round(data.stat().st_size / 2**20, 1),
                                    "ranks": args.nproc, "runs": rows, "table": report, **run_record()},
                                   indent=2) + "\n")


if __name__ == "__main__":
    main()
