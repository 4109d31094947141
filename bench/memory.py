"""Per-rank memory, load time and speed of shardtune against peer recipes, side by side.

    .venv/bin/python bench/memory.py --size 1.1b            # 2 ranks, batch 1 × 128 tokens per rank
    .venv/bin/python bench/memory.py --size 7b --recipes shardtune-fsdp2 --malloc mmap

Makes (once, under --cache) a random-weight Llama-shape bf16 checkpoint of the size asked for
(fake_model.py), then runs every recipe × malloc setting as its own fresh 2-process job
(peers.py), prints a table and writes bench/results/memory-<size>.json. "default" runs glibc as
it comes (shardtune too: SHARDTUNE_MALLOC=default); "mmap" sets MALLOC_MMAP_THRESHOLD_=131072 for
every recipe, which is what shardtune sets for itself when nothing is said (cpu_tuning.tune_malloc;
"asis" runs every recipe with nothing set).
The planner's prediction (``shardtune plan``) for the same configuration sits next to shardtune's rows.
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

from fake_model import SIZES, make_checkpoint, make_data
from record import run_record

HERE = Path(__file__).resolve().parent
RECIPES: dict[str, list[str]] = {
    "shardtune-fsdp2": ["shardtune", "--strategy", "fsdp2"],
    "shardtune-fsdp1": ["shardtune", "--strategy", "fsdp1"],
    "shardtune-ddp": ["shardtune", "--strategy", "ddp"],
    "shardtune-fsdp2-ac": ["shardtune", "--strategy", "fsdp2", "--activation-checkpointing"],
    "shardtune-fsdp2-offload": ["shardtune", "--strategy", "fsdp2", "--cpu-offload"],
    "shardtune-fsdp2-nf4": ["shardtune", "--strategy", "fsdp2", "--quantize", "nf4"],
    "shardtune-fsdp2-ac-nf4": ["shardtune", "--strategy", "fsdp2", "--quantize", "nf4", "--activation-checkpointing"],
    "naive": ["naive"],
    "broadcast": ["broadcast"],
    "fsdp1-peft": ["fsdp1-peft"],
    "fsdp1-orig-params": ["fsdp1-orig-params"],
    "torchtune-nf4": ["torchtune-nf4"],  # every rank: whole bf16 state dict, to_nf4, fully_shard
}
DEFAULT_RECIPES = "shardtune-fsdp2,shardtune-fsdp1,shardtune-ddp,naive,broadcast,fsdp1-peft"
# default: glibc as it comes, for every recipe; mmap: the threshold in the environment, for every recipe;
# asis: nothing set (shardtune then sets the threshold itself: cpu_tuning.tune_malloc; peers run glibc's default).
MALLOC_ENV = {"default": {"SHARDTUNE_MALLOC": "default"}, "mmap": {"MALLOC_MMAP_THRESHOLD_": "131072"}, "asis": {}}


def run_job(recipe: str, malloc: str, model: Path, data: Path, args: argparse.Namespace) -> dict:
    """One fresh 2-process job; the per-rank results, or the error it ended with."""
    out = Path(tempfile.mkdtemp(prefix=f"bench-{recipe}-"))
    env = {k: v for k, v in os.environ.items() if k not in ("MALLOC_MMAP_THRESHOLD_", "SHARDTUNE_MALLOC")}
    env.update(MALLOC_ENV[malloc])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
           str(HERE / "peers.py"), *RECIPES[recipe], "--model", str(model), "--data", str(data),
           "--out", str(out), "--steps", str(args.steps), "--seq-len", str(args.seq_len), "--dtype", args.dtype]
    started = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    job = {"recipe": recipe, "malloc": malloc, "wall_seconds": round(time.perf_counter() - started, 1)}
    ranks = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    if proc.returncode or len(ranks) != args.nproc:
        (out / "log.txt").write_text(proc.stdout + proc.stderr)
        worker = [ln for ln in proc.stderr.splitlines() if ln.startswith("[rank")]  # the workers' tracebacks
        tail = (worker or [ln for ln in proc.stderr.splitlines() if ln.strip()])[-12:]
        return {**job, "error": "\n".join(tail), "log": str(out / "log.txt")}
    for key in ("load_peak_mb", "train_peak_mb", "read_mb"):
        job[key] = [round(r[key], 1) for r in ranks]
    for key in ("load_seconds", "tokens_per_second", "loss_first", "loss_last"):
        job[key] = round(max(r[key] for r in ranks), 3)
    return job


def predictions(model: Path, args: argparse.Namespace) -> dict[str, dict]:
    """The planner's per-rank peak for each shardtune recipe, same flags as the jobs."""
    from shardtune.config import build_config
    from shardtune.train.choice import strategy_rows

    out = {}
    for quantize in ("none", "nf4"):
        cfg = build_config({"model": str(model), "nproc": args.nproc, "batch-size": args.nproc,
                            "micro-batch-size": 1, "seq-len": args.seq_len, "lora-r": 8,
                            "lora-targets": "q_proj,v_proj", "quantize": quantize, "device": "cpu",
                            "dtype": args.dtype})
        for strategy, preds in strategy_rows(cfg).items():
            for p in preds:
                name = (f"shardtune-{strategy}{'-ac' * p.activation_checkpointing}{'-offload' * p.cpu_offload}"
                        f"{'-nf4' * (quantize == 'nf4')}")
                if p.terms:
                    out[name] = p.as_dict()
    return out


def targets(jobs: list[dict], plans: dict[str, dict]) -> list[str]:
    """The issue's targets, each with its numbers: met or not."""
    lines = []
    peers = [j for j in jobs if not j["recipe"].startswith("shardtune") and "error" not in j]
    for j in jobs:
        p = plans.get(j["recipe"])
        if "error" in j or p is None:
            continue
        train, load = max(j["train_peak_mb"]), max(j["load_peak_mb"])
        t = p["terms"]
        if j["recipe"].endswith("-nf4"):  # runtime + NF4 shard + the largest bf16 slice being quantized, + 10%
            slice_mb = p.get("quantize_slice_mb", 0.0)
            load_bound = 1.1 * (t["runtime"] + t["weights"] + slice_mb)
            what = "1.1*(runtime+nf4 shard+bf16 slice)"
        else:
            load_bound = t["runtime"] + 1.1 * t["weights"] + p["block_mb"]
            what = "runtime+1.1*shard+block"
        lines.append(f"{j['recipe']:<24} {j['malloc']:<7} load {load:7.0f} <= {what} "
                     f"{load_bound:7.0f}: {'yes' if load <= load_bound else 'NO'}")
        err = (p["peak_mb"] - train) / train
        lines.append(f"{'':<32} train {train:7.0f}; planner {p['peak_mb']:7.0f} ({err:+.1%}) "
                     f"within 10%: {'yes' if abs(err) <= 0.10 else 'NO'}; <= 1.1*planner: "
                     f"{'yes' if train <= 1.1 * p['peak_mb'] else 'NO'}")
        if j["recipe"].endswith("-nf4"):
            lines += _nf4_targets(j, jobs, peers)
            continue
        bf16_peers = [q for q in peers if not q["recipe"].endswith("-nf4")]  # like for like: unquantized
        same = [max(q["train_peak_mb"]) for q in bf16_peers if q["malloc"] == j["malloc"]]
        if same:
            best = min(same)
            lines.append(f"{'':<32} best peer ({j['malloc']}) {best:7.0f}: ratio {train / best:.2f} <= 0.75: "
                         f"{'yes' if train <= 0.75 * best else 'NO'}")
        # shardtune sets the mmap threshold itself; peers run glibc's defaults unless told otherwise.
        shipped = [max(q["train_peak_mb"]) for q in bf16_peers if q["malloc"] == "default"]
        if j["malloc"] == "mmap" and shipped:
            best = min(shipped)
            lines.append(f"{'':<32} best peer as shipped (default) {best:7.0f}: ratio {train / best:.2f} "
                         f"<= 0.75: {'yes' if train <= 0.75 * best else 'NO'}")
    return lines


def _nf4_targets(j: dict, jobs: list[dict], peers: list[dict]) -> list[str]:
    """QLoRA: whole-run peak <= 0.5x the torchtune-style peer's, train peak no higher, tokens/s >= 0.6x bf16."""
    lines = []
    whole = max(max(j["train_peak_mb"]), max(j["load_peak_mb"]))
    for q in peers:
        if q["recipe"] == "torchtune-nf4" and q["malloc"] == j["malloc"]:
            peer_whole = max(max(q["train_peak_mb"]), max(q["load_peak_mb"]))
            lines.append(f"{'':<32} whole-run {whole:7.0f} vs torchtune-nf4 {peer_whole:7.0f}: ratio "
                         f"{whole / peer_whole:.2f} <= 0.5: {'yes' if whole <= 0.5 * peer_whole else 'NO'}; train "
                         f"{max(j['train_peak_mb']):.0f} <= {max(q['train_peak_mb']):.0f}: "
                         f"{'yes' if max(j['train_peak_mb']) <= max(q['train_peak_mb']) else 'NO'}")
    for b in jobs:
        if b["recipe"] == j["recipe"].removesuffix("-nf4") and b["malloc"] == j["malloc"] and "error" not in b:
            ratio = j["tokens_per_second"] / b["tokens_per_second"]
            lines.append(f"{'':<32} tokens/s {j['tokens_per_second']:.1f} vs bf16 {b['tokens_per_second']:.1f}: "
                         f"ratio {ratio:.2f} >= 0.6: {'yes' if ratio >= 0.6 else 'NO'}")
    return lines


def table(jobs: list[dict], plans: dict[str, dict]) -> str:
    head = (f"{'recipe':<24} {'malloc':<7} {'load MB r0/r1':>15} {'train MB r0/r1':>15} {'load s':>7} "
            f"{'tok/s':>6} {'read MB/rank':>13} {'plan MB':>8}")
    rows = [head, "-" * len(head)]
    for j in jobs:
        if "error" in j:
            rows.append(f"{j['recipe']:<24} {j['malloc']:<7} failed: {j['error'].splitlines()[-1][:80]}")
            continue
        plan = plans.get(j["recipe"], {}).get("peak_mb")
        name = j["recipe"] + " *" * ("earlier" in j)
        rows.append(
            f"{name:<24} {j['malloc']:<7} {'/'.join(f'{v:.0f}' for v in j['load_peak_mb']):>15} "
            f"{'/'.join(f'{v:.0f}' for v in j['train_peak_mb']):>15} {j['load_seconds']:7.1f} "
            f"{j['tokens_per_second']:6.1f} {'/'.join(f'{v:.0f}' for v in j['read_mb']):>13} "
            f"{f'{plan:.0f}' if plan else '-':>8}")
    return "\n".join(rows)


def earlier_jobs(path: Path, args: argparse.Namespace) -> list[dict]:
    """The jobs of an earlier run, refused unless it measured the same configuration."""
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        sys.exit(f"--with {path}: cannot read it ({e})")
    for key, value in (("size", args.size), ("ranks", args.nproc), ("dtype", args.dtype), ("seq_len", args.seq_len)):
        if old.get(key) != value:
            sys.exit(f"--with {path}: it measured {key}={old.get(key)!r}, this run {value!r}")
    return [j for j in old["jobs"] if "error" not in j]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="1.1b")
    parser.add_argument("--cache", type=Path, default=HERE / ".cache", help="where checkpoints are made once")
    parser.add_argument("--recipes", default=DEFAULT_RECIPES, help=f"comma-separated, of: {', '.join(RECIPES)}")
    parser.add_argument("--malloc", choices=("both", *MALLOC_ENV), default="both", help="both: default and mmap")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per job")
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"),
                        help="compute dtype of every recipe (the checkpoint stays bf16): fp32 on CPUs without "
                             "bf16 matmul (AVX2 only: bf16 gemm runs at 0.2-6 GFLOP/s there, fp32 at 24-38)")
    parser.add_argument("--out", type=Path, help="JSON results [default: bench/results/memory-<size>.json]")
    parser.add_argument("--with", dest="earlier", type=Path, action="append", default=[],
                        help="an earlier results file of the same size, ranks, dtype and seq-len: its jobs join "
                             "this table and its targets (a 7B job takes up to an hour; rerun only what changed)")
    args = parser.parse_args()
    recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
    unknown = [r for r in recipes if r not in RECIPES]
    if unknown:
        parser.error(f"unknown recipes: {', '.join(unknown)}")
    model = make_checkpoint(args.size, args.cache)
    data = make_data(args.cache / f"data-{args.seq_len}.jsonl", seq_len=args.seq_len)
    plans = predictions(model, args)
    mallocs = ("default", "mmap") if args.malloc == "both" else (args.malloc,)
    jobs = [dict(job, earlier=str(path)) for path in args.earlier for job in earlier_jobs(path, args)]
    for malloc in mallocs:
        for recipe in recipes:
            print(f"running {recipe} ({malloc} malloc) ...", file=sys.stderr, flush=True)
            jobs.append(run_job(recipe, malloc, model, data, args))
            print(table(jobs[-1:], plans).splitlines()[-1], file=sys.stderr, flush=True)
    report = table(jobs, plans) + "\n\ntargets:\n" + "\n".join(targets(jobs, plans))
    if args.earlier:
        report += "\n\n* measured earlier: " + ", ".join(str(p) for p in args.earlier)
    print(report)
    out = args.out or HERE / "results" / f"memory-{args.size}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"size": args.size, "ranks": args.nproc, "steps": args.steps, "dtype": args.dtype,
                               "seq_len": args.seq_len, "jobs": jobs, "planner": plans, "table": report,
                               **run_record()}, indent=2))
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
