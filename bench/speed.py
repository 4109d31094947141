"""Real (non-padding) tokens/s and per-rank peak memory of shardtune and the peer recipes, side by side.

    flock /tmp/bigrun.lock .venv/bin/python bench/speed.py                 # every job below
    flock /tmp/bigrun.lock .venv/bin/python bench/speed.py --jobs small    # only the 1 × 128 comparison

The 1.1B random Llama-shape bf16 checkpoint (fake_model.py, made once under --cache), 2 ranks, LoRA
r8 on q,v. Each job is a fresh 2-process run (peers.py), as in bench/memory.py.

Job groups:
  mixed   a mixed-length instruction dataset (record lengths log-normal, median ~100 tokens,
          16..512), --seq-len 512, 8 records per micro-batch per rank: shardtune padded (each
          micro-batch padded to its longest record) and packed, under fsdp2 and ddp; the peers
          (naive FSDP2, FSDP1 + peft's policy) padded, as they collate.
  small   1 × 128 tokens per rank (fixed-length records): fsdp2 with per-part units and with
          whole-layer units, against ddp, and as before this issue: per-part units gathering through
          gloo (a job named "gloo" runs with SHARDTUNE_SHARED_GATHER=0, without shared-memory gathers).
  large   4 × 512 tokens per rank: fsdp2 (whole-layer units) against ddp, and gathering through gloo.
  budget  --memory-per-rank (--budget-gib, 3 at 1.1B): shardtune's automatic choice (packing, --strategy auto,
          --micro-batch-size auto) on the mixed data, against each peer's largest micro-batch
          that the same budget holds (measured peak <= the budget; tried from 8 down).
  rule    the check of auto's speed rule: the --rule-top settings that fit the same budget, in the
          order the rule ranks them (choice.py), each run as fixed options on the budget job's data;
          the rule holds where the measured tokens/s fall in that order.
Writes bench/results/speed-1.1b.json and prints the table with the issue's ratios. --repeat N runs
the chosen jobs N times, in turn (A B A B ...), so that a drift of the machine's speed hits each
alike; a job's tokens/s is then the median of its runs, and each pair's per-round ratio is listed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from fake_model import SIZES, make_checkpoint, make_data
from record import run_record
from shardtune.runtime.cpu_tuning import worker_malloc_env

HERE = Path(__file__).resolve().parent
GIB = 1024**3

MIXED = ["--seq-len", "512", "--micro-batch-size", "8"]
JOBS: dict[str, list[tuple[str, list[str], str]]] = {
    # (name, peers.py arguments, data: mixed | fixed128 | fixed512)
    "small": [
        ("fsdp2-part gloo 1x128", ["shardtune", "--strategy", "fsdp2", "--fsdp-unit", "part", "--seq-len", "128"],
         "fixed128"),
        ("fsdp2-part 1x128", ["shardtune", "--strategy", "fsdp2", "--fsdp-unit", "part", "--seq-len", "128"],
         "fixed128"),
        ("fsdp2-layer 1x128", ["shardtune", "--strategy", "fsdp2", "--fsdp-unit", "layer", "--seq-len", "128"],
         "fixed128"),
        ("ddp 1x128", ["shardtune", "--strategy", "ddp", "--seq-len", "128"], "fixed128"),
    ],
    "mixed": [
        ("fsdp2 padded", ["shardtune", "--strategy", "fsdp2", "--fsdp-unit", "layer", *MIXED], "mixed"),
        ("fsdp2 packed", ["shardtune", "--strategy", "fsdp2", "--fsdp-unit", "layer", "--packing", *MIXED], "mixed"),
        ("ddp padded", ["shardtune", "--strategy", "ddp", *MIXED], "mixed"),
        ("ddp packed", ["shardtune", "--strategy", "ddp", "--packing", *MIXED], "mixed"),
        ("peer naive padded", ["naive", *MIXED], "mixed"),
        ("peer fsdp1-peft padded", ["fsdp1-peft", *MIXED], "mixed"),
    ],
    "large": [
        ("fsdp2-layer 4x512", ["shardtune", "--strategy", "fsdp2", "--fsdp-unit", "layer", "--seq-len", "512",
                               "--micro-batch-size", "4"], "fixed512"),
        ("ddp 4x512", ["shardtune", "--strategy", "ddp", "--seq-len", "512", "--micro-batch-size", "4"], "fixed512"),
        ("fsdp2-layer gloo 4x512", ["shardtune", "--strategy", "fsdp2", "--fsdp-unit", "layer", "--seq-len", "512",
                                    "--micro-batch-size", "4"], "fixed512"),
    ],
    "budget": [],  # made in main(): the budget is --budget-gib
    "rule": [],  # made in main(): the settings that fit --budget-gib
}


def mixed_data(path: Path, n: int = 96, seed: int = 0) -> Path:
    """Instruction records whose lengths spread like real instruction data: log-normal, median ~100
    tokens, cut to 16..512 (the tokenizer is byte-level: one token per character)."""
    if path.is_file():
        return path
    words = ["red", "blue", "cat", "dog", "sun", "moon", "tree", "sea", "rock", "bird", "river", "stone"]
    g = torch.Generator().manual_seed(seed)
    lines = []
    for _ in range(n):
        length = int(min(512, max(16, math.exp(math.log(100) + 0.8 * float(torch.randn(1, generator=g))))))
        text = " ".join(words[int(j)] for j in torch.randint(0, len(words), (length // 4 + 1,), generator=g))
        cut = max(4, length // 3)  # about a third prompt, the rest response; the chat template adds ~25
        lines.append(json.dumps({"instruction": text[:cut], "output": text[cut:max(cut + 4, length - 25)]}))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def run_job(name: str, argv: list[str], model: Path, data: Path, args: argparse.Namespace) -> dict:
    out = Path(tempfile.mkdtemp(prefix="speed-"))
    env = {k: v for k, v in os.environ.items()
           if k not in ("MALLOC_MMAP_THRESHOLD_", "SHARDTUNE_MALLOC", "GLIBC_TUNABLES")}
    # The same allocator settings for every recipe: shardtune's own (its launcher's, which torchrun
    # here is not): the mmap threshold and, unless --no-huge-pages, glibc's huge pages.
    env["MALLOC_MMAP_THRESHOLD_"] = "131072"
    env.update(worker_malloc_env("cpu", {}) if args.huge_pages else {})
    if " gloo " in f" {name} ":  # FSDP2 gathering through gloo, not shared memory (parallel/host_gather.py)
        env["SHARDTUNE_SHARED_GATHER"] = "0"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(HERE / "peers.py"),
           *argv, "--model", str(model), "--data", str(data), "--out", str(out), "--steps", str(args.steps),
           "--dtype", args.dtype]
    if args.activation_checkpointing and argv[0] == "shardtune":
        cmd.append("--activation-checkpointing")
    started = time.perf_counter()
    # A session of its own: on timeout the workers go too (torchrun's children outlive a killed torchrun,
    # and shardtune's workers wait for the step's end on SIGTERM).
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return {"name": name, "argv": argv, "error": f"ran past --timeout {args.timeout} s"}
    job = {"name": name, "argv": argv, "wall_seconds": round(time.perf_counter() - started, 1),
           "huge_pages": args.huge_pages, "activation_checkpointing": args.activation_checkpointing}
    ranks = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    if proc.returncode or len(ranks) != 2:
        (out / "log.txt").write_text(stdout + stderr)
        tail = [ln for ln in stderr.splitlines() if ln.strip()][-8:]
        return {**job, "error": "\n".join(tail), "log": str(out / "log.txt")}
    job["train_peak_mb"] = [round(r["train_peak_mb"], 1) for r in ranks]
    job["tokens_per_second"] = round(max(r["tokens_per_second"] for r in ranks), 2)
    job["fill_ratio"] = ranks[0].get("fill_ratio")
    job["chosen"] = ranks[0].get("chosen")
    job["loss_first"] = ranks[0]["loss_first"]
    return job


def merge_runs(runs: list[dict]) -> dict:
    """One job's repeated runs: the median tokens/s, the highest peak of each rank, every run's figures."""
    ok = [r for r in runs if "error" not in r]
    if len(runs) == 1 or not ok:
        return runs[0]
    job = dict(ok[0])
    job["tokens_per_second"] = round(statistics.median(r["tokens_per_second"] for r in ok), 2)
    job["train_peak_mb"] = [max(r["train_peak_mb"][i] for r in ok) for i in range(len(ok[0]["train_peak_mb"]))]
    job["runs"] = [{k: r.get(k) for k in ("tokens_per_second", "train_peak_mb", "wall_seconds", "error")
                    if k in r} for r in runs]
    return job


def paired(jobs: list[dict], a: str, b: str) -> str | None:
    """Per-round ratios of two repeated jobs (run in turn, so each round's pair saw the same machine)."""
    by_name = {j["name"]: j for j in jobs}
    if a not in by_name or b not in by_name or "runs" not in by_name[a] or "runs" not in by_name[b]:
        return None
    pairs = [x["tokens_per_second"] / y["tokens_per_second"] for x, y in zip(by_name[a]["runs"], by_name[b]["runs"])
             if "error" not in x and "error" not in y]
    return f"  per round: {', '.join(f'{r:.3f}' for r in pairs)} (median {statistics.median(pairs):.3f})"


def table(jobs: list[dict]) -> str:
    rows = [f"{'job':<28} {'real tok/s':>10} {'peak MB r0/r1':>15} {'fill':>5}  chosen", "-" * 80]
    for j in jobs:
        if "error" in j:
            rows.append(f"{j['name']:<28} failed: {j['error'].splitlines()[-1][:90] if j['error'] else ''}")
            continue
        fill = f"{j['fill_ratio']:.2f}" if j.get("fill_ratio") else "-"
        rows.append(f"{j['name']:<28} {j['tokens_per_second']:10.2f} "
                    f"{'/'.join(f'{v:.0f}' for v in j['train_peak_mb']):>15} {fill:>5}  {j.get('chosen') or ''}")
    return "\n".join(rows)


def budget_jobs(gib: float) -> list[tuple[str, list[str], str]]:
    return [(f"shardtune auto {gib:g}GiB packed",
             ["shardtune", "--strategy", "auto", "--packing", "--micro-batch-size", "0", "--batch-per-rank", "8",
              "--fsdp-unit", "auto", "--memory-per-rank", f"{gib:g}GiB", "--seq-len", "512"], "mixed")]


def rule_jobs(model: Path, data: Path, gib: float, dtype: str, top: int) -> list[tuple[str, list[str], str]]:
    """The budget job's setting and the next ones the speed rule ranks, best first, as fixed options."""
    from shardtune.config import build_config
    from shardtune.model.directory import check_model_dir, load_tokenizer
    from shardtune.train.choice import Candidate, candidates
    from shardtune.train.data.records import lengths_of
    from shardtune.train.data.tokenize import load_dataset

    cfg = build_config({"model": str(model), "data": str(data), "nproc": 2, "strategy": "auto", "packing": True,
                        "batch-size": 16, "micro-batch-size": "auto", "fsdp-unit": "auto", "seq-len": 512,
                        "lora-r": 8, "lora-alpha": 16, "lora-targets": "q_proj,v_proj", "dtype": dtype})
    tokenizer = load_tokenizer(check_model_dir(str(model)))
    lengths = lengths_of(load_dataset(str(data), tokenizer, 512).examples)
    fitting = sorted((c for c, fits in candidates(cfg, int(gib * GIB), lengths) if fits), key=Candidate.key)
    jobs = []
    for i, c in enumerate(fitting[:top], 1):
        argv = ["shardtune", "--strategy", c.strategy, "--fsdp-unit", c.fsdp_unit if c.fsdp_unit != "-" else "part",
                "--packing", "--micro-batch-size", str(c.micro_batch_size), "--batch-per-rank", "8", "--seq-len", "512"]
        jobs.append((f"rule {i}: {c.describe()} ({c.collectives} gathers, {c.peak_mb:.0f} MB predicted)",
                     argv + ["--activation-checkpointing"] * c.activation_checkpointing, "mixed"))
    return jobs


def ratios(jobs: list[dict], gib: float = 3.0) -> list[str]:
    speed = {j["name"]: j["tokens_per_second"] for j in jobs if "error" not in j}
    peak = {j["name"]: max(j["train_peak_mb"]) for j in jobs if "error" not in j}
    lines = []

    def ratio(a: str, b: str, target: float, what: str) -> None:
        if a in speed and b in speed:
            r = speed[a] / speed[b]
            lines.append(f"{what}: {a} / {b} = {r:.3f} (target >= {target}: {'yes' if r >= target else 'NO'})")
            rounds = paired(jobs, a, b)
            if rounds:
                lines.append(rounds)

    ratio("fsdp2 packed", "fsdp2 padded", 2.0, "packing vs padding (fsdp2)")
    ratio("ddp packed", "ddp padded", 2.0, "packing vs padding (ddp)")
    before = "fsdp2-part gloo 1x128"  # fsdp2 as it was before this issue
    ratio("fsdp2-part 1x128", "ddp 1x128", 0.5, "fsdp2 (per-part units) vs ddp at 1 x 128")
    ratio("fsdp2-layer 1x128", "ddp 1x128", 0.5, "fsdp2 (whole-layer units) vs ddp at 1 x 128")
    ratio(before, "ddp 1x128", 0.0, "fsdp2 before (per-part units, gloo gathers) vs ddp at 1 x 128")
    ratio("fsdp2-part 1x128", before, 0.0, "shared-memory gathers vs gloo's at 1 x 128 (per-part units)")
    ratio("fsdp2-layer 4x512", "ddp 4x512", 0.95, "fsdp2 vs ddp at 4 x 512")
    ratio("fsdp2-layer gloo 4x512", "ddp 4x512", 0.0, "fsdp2 gathering through gloo vs ddp at 4 x 512")
    for unit in ("part", "layer"):
        if f"fsdp2-{unit} 1x128" in peak and before in peak:
            r = peak[f"fsdp2-{unit} 1x128"] / peak[before]
            lines.append(f"fsdp2 peak at 1 x 128, {unit} units / before = {r:.2f} "
                         f"(target <= 1.10: {'yes' if r <= 1.1 else 'NO'})")
    auto = f"shardtune auto {gib:g}GiB packed"
    # every peer job runs the mixed data at --seq-len 512: the padded ones (m8) count when they fit too;
    # the peers' budget jobs of another budget do not
    peers = [n for n in speed if n.startswith("peer") and peak[n] <= gib * 1024
             and ("GiB" not in n or f" {gib:g}GiB " in n)]
    if auto in speed and peers:
        best = max(peers, key=lambda n: speed[n])
        ratio(auto, best, 1.5, f"at {gib:g} GiB per rank, shardtune's choice vs the best peer that fits")
    ranked = sorted((n for n in speed if n.startswith("rule ")), key=lambda n: int(n.split()[1].rstrip(":")))
    if len(ranked) > 1:
        order = [speed[n] for n in ranked]
        held = all(a >= b for a, b in zip(order, order[1:]))
        lines.append(f"speed rule at {gib:g} GiB: measured tokens/s in the rule's order "
                     f"{', '.join(f'{v:.2f}' for v in order)} ({'holds' if held else 'does NOT hold'}; "
                     f"first is fastest: {'yes' if order[0] == max(order) else 'NO'})")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", default="small,mixed,large,budget", help="job groups: " + ", ".join(JOBS))
    parser.add_argument("--only", default="", help="comma-separated job names to run (default: all in the groups)")
    parser.add_argument("--peer-budget", default="4,2,1",
                        help="micro-batch sizes tried for the peers at the budget, largest first (8: mixed group)")
    parser.add_argument("--budget-gib", type=float, default=3.0,
                        help="the budget group's memory per rank (3 GiB is sized for 1.1b; scale it with --size)")
    parser.add_argument("--cache", type=Path, default=HERE / ".cache")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--rule-top", type=int, default=4, help="how many settings the rule group runs")
    parser.add_argument("--repeat", type=int, default=1, help="run the chosen jobs this many times, in turn")
    parser.add_argument("--timeout", type=int, default=1800)
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"),
                        help="compute dtype of every job: fp32 on CPUs without bf16 matmul (AVX2 only)")
    parser.add_argument("--size", default="1.1b", choices=sorted(SIZES),
                        help="the random Llama-shape checkpoint (the budget group's 3 GiB is sized for 1.1b)")
    parser.add_argument("--activation-checkpointing", action="store_true",
                        help="every shardtune job checkpoints activations (for batches whose activations "
                             "would not fit otherwise; the peers never do)")
    parser.add_argument("--no-huge-pages", dest="huge_pages", action="store_false",
                        help="run every job without glibc's huge pages (shardtune's launcher sets them on CPU)")
    parser.add_argument("--out", type=Path, help="[default: bench/results/speed-<size>.json]")
    args = parser.parse_args()
    args.out = args.out or HERE / "results" / f"speed-{args.size}.json"
    model = make_checkpoint(args.size, args.cache)
    data = {"mixed": mixed_data(args.cache / "data-mixed.jsonl"),
            "fixed128": make_data(args.cache / "data-128.jsonl", seq_len=128),
            "fixed512": make_data(args.cache / "data-512.jsonl", seq_len=512)}
    only = {n.strip() for n in args.only.split(",") if n.strip()}
    previous = json.loads(args.out.read_text())["jobs"] if args.out.is_file() else []
    jobs = {j["name"]: j for j in previous}  # a partial run keeps the other jobs' last results
    gib = args.budget_gib
    for group in [g.strip() for g in args.jobs.split(",") if g.strip()]:
        planned = list(JOBS[group])
        if group == "rule":
            planned = rule_jobs(model, data["mixed"], gib, args.dtype, args.rule_top)
        if group == "budget":
            planned = budget_jobs(gib)
            for peer in ("naive", "fsdp1-peft"):
                for m in [int(x) for x in args.peer_budget.split(",")]:
                    planned.append((f"peer {peer} {gib:g}GiB m{m}",
                                    [peer, "--seq-len", "512", "--micro-batch-size", str(m)], "mixed"))
        fitted: set[str] = set()  # peers whose largest micro-batch within the budget is found
        ran: list[tuple[str, list[str], str]] = []
        for name, argv, which in planned:
            peer = name.rsplit(" m", 1)[0] if group == "budget" and name.startswith("peer") else None
            padded = f"{peer.replace(f' {gib:g}GiB', '')} padded" if peer else ""  # the same peer at m8 (mixed)
            if padded in jobs and "error" not in jobs[padded] and max(jobs[padded]["train_peak_mb"]) <= gib * 1024:
                fitted.add(peer)
            if (only and name not in only) or peer in fitted:
                continue
            print(f"running {name} ...", file=sys.stderr, flush=True)
            jobs[name] = run_job(name, argv, model, data[which], args)
            ran.append((name, argv, which))
            print(table([jobs[name]]).splitlines()[-1], file=sys.stderr, flush=True)
            if peer and "error" not in jobs[name] and max(jobs[name]["train_peak_mb"]) <= gib * 1024:
                fitted.add(peer)
        runs = {name: [jobs[name]] for name, _, _ in ran}
        for round_ in range(2, args.repeat + 1):  # the same jobs again, in the same order
            for name, argv, which in ran:
                print(f"running {name} (round {round_}) ...", file=sys.stderr, flush=True)
                runs[name].append(run_job(name, argv, model, data[which], args))
                print(table([runs[name][-1]]).splitlines()[-1], file=sys.stderr, flush=True)
        for name, done in runs.items():
            jobs[name] = merge_runs(done)
    ordered = list(jobs.values())
    report = table(ordered) + "\n\n" + "\n".join(ratios(ordered, args.budget_gib))
    print(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"model": f"llama-{args.size} (random, bf16)", "ranks": 2, "steps": args.steps,
                                    "repeat": args.repeat, "dtype": args.dtype, "budget_gib": args.budget_gib,
                                    "jobs": ordered, "table": report, **run_record()}, indent=2))
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
