"""Context parallelism: how much longer a context the same per-rank memory holds with --context-parallel N,
what it costs in speed against data parallelism, and how close the planner is.

    nice -n 10 python bench/context_parallel.py                       # 2 layers: 2k, 4k, 8k tokens; CP 1, 2, DP 2
    python bench/context_parallel.py --layers 4 --lengths 4096,8192,16384 --cp 1,2,4
    python bench/context_parallel.py --quick                          # tiny lengths: the pipeline in a minute

The model is bench/long_context.py's random Llama of SmolLM2-135M-Instruct's shape (hidden 576, MLP 1536,
9 heads, 3 key/value heads, the real 49,152-token vocabulary, tied embeddings) with ``--layers`` decoder
layers (default 2: the real width and vocabulary, shallower so that the rows fit this machine; the per-token
terms scale with the layers, the ratios below much less). Every row: ``shardtune finetune --strategy
fsdp2`` (``single`` on one process), LoRA r16 all-linear, fp32, ``--activation-checkpointing``, records of
exactly the row's length, one record per data-parallel group per step, ``--steps`` steps.

Rows: ``cp N`` runs N processes with ``--context-parallel N`` (CP 1: one process), so each rank holds 1/N of
the record; ``dp 2`` runs 2 processes, one record each (the same per-rank tokens as CP 1, twice the records
per step). Per row: the per-rank peak (the summary's ``train_peak_mb``, the busiest rank), tokens/s (step 1
left out as warm-up), and ``shardtune plan --json``'s predicted peak.

Figures: per CP size, the peak's growth per token (a line through its rows) and the longest context within
the per-rank budget (``--budget-mib``; default: CP 1's peak at the longest length, so CP 1's longest is that
length), with its ratio to CP 1's (issue 33's targets: ≥ 1.8× at CP 2, ≥ 3.4× at CP 4); tokens/s of CP 2
over DP 2 at each length both ran (target ≥ 0.85); planner over measured, per row (target within ±10%).
Writes bench/results/context-parallel-<layers>l.json (``--quick``: bench/.cache/).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(HERE), str(ROOT / "src"), str(ROOT / "tests")]
from long_context import LORA, make_model, make_records  # noqa: E402
from record import run_record  # noqa: E402


def flags(model: Path, data: Path, tokens: int, nproc: int, cp: int, steps: int) -> list[str]:
    strategy = "single" if nproc == 1 else "fsdp2"
    return ["--model", str(model), "--data", str(data), "--nproc", str(nproc), "--strategy", strategy,
            "--context-parallel", str(cp), "--dtype", "fp32", "--seq-len", str(tokens),
            "--batch-size", str(nproc // cp), "--micro-batch-size", "1", "--lora-r", str(LORA["r"]),
            "--lora-alpha", str(LORA["alpha"]), "--lora-targets", "all-linear", "--activation-checkpointing",
            "--steps", str(steps), "--warmup-steps", "0"]


def shardtune(*args: str, timeout: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    return subprocess.run([sys.executable, "-m", "shardtune", *args], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=timeout)


def row(kind: str, n: int, tokens: int, model: Path, cache: Path, args: argparse.Namespace) -> dict:
    nproc, cp = n, (n if kind == "cp" else 1)
    data = make_records(cache, tokens, max(1, nproc // cp) * args.steps)
    out = Path(tempfile.mkdtemp(prefix=f"{kind}{n}-{tokens}-", dir=cache))
    base = flags(model, data, tokens, nproc, cp, args.steps)
    started = time.perf_counter()
    done = shardtune("finetune", *base, "--out", str(out / "run"), timeout=args.timeout)
    entry = {"row": f"{kind} {n}", "kind": kind, "ranks": nproc, "context_parallel": cp, "tokens": tokens,
             "command": shlex.join(["shardtune", "finetune", *base]), "wall_seconds": time.perf_counter() - started}
    if done.returncode:
        return {**entry, "error": (done.stderr or done.stdout)[-1500:]}
    summary = json.loads((out / "run" / "summary.json").read_text())
    steps = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines() if line.strip()]
    timed = steps[1:] or steps
    entry.update(peak_mb=max(summary["train_peak_mb"]), runtime_mb=max(summary["runtime_mb"]),
                 tokens_per_second=sum(s["tokens"] for s in timed) / sum(s["seconds"] for s in timed),
                 loss_first=summary["train_loss_first"])
    planned = shardtune("plan", *base, "--json", timeout=args.timeout)
    if planned.returncode == 0:
        strategy = "single" if nproc == 1 else "fsdp2"
        entry["planned_mb"] = json.loads(planned.stdout)[strategy]["peak_mb"]
    else:
        entry["plan_error"] = (planned.stderr or planned.stdout)[-500:]
    return entry


def line(points: list[tuple[int, float]]) -> tuple[float, float] | None:
    """Least-squares (intercept MB, MB per token) through (tokens, peak MB) points; None under two."""
    if len(points) < 2:
        return None
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    return my - slope * mx, slope


def figures(rows: list[dict], budget: float | None) -> dict:
    ok = [r for r in rows if "peak_mb" in r]
    cps = sorted({r["context_parallel"] for r in ok if r["kind"] == "cp"})
    fits = {cp: line([(r["tokens"], r["peak_mb"]) for r in ok if r["kind"] == "cp" and r["context_parallel"] == cp])
            for cp in cps}
    one = [r for r in ok if r["kind"] == "cp" and r["context_parallel"] == 1]
    if budget is None and one:
        budget = max(one, key=lambda r: r["tokens"])["peak_mb"]
    longest = {cp: (budget - f[0]) / f[1] for cp, f in fits.items() if f and f[1] > 0 and budget}
    out: dict = {"budget_mib": budget,
                 "mb_per_token": {cp: f[1] for cp, f in fits.items() if f},
                 "longest_tokens": {cp: round(t) for cp, t in longest.items()},
                 "longest_ratio": {cp: t / longest[1] for cp, t in longest.items() if 1 in longest}}
    speed = {}
    for r in ok:
        if r["kind"] == "cp" and r["context_parallel"] == 2:
            dp = next((d for d in ok if d["kind"] == "dp" and d["ranks"] == 2 and d["tokens"] == r["tokens"]), None)
            if dp:
                speed[r["tokens"]] = r["tokens_per_second"] / dp["tokens_per_second"]
    out["cp2_over_dp2_tokens_per_second"] = speed
    out["planner_over_measured"] = {f"{r['row']} {r['tokens']}": r["planned_mb"] / r["peak_mb"]
                                    for r in ok if "planned_mb" in r}
    return out


def table(rows: list[dict], figs: dict) -> str:
    lines = ["| row | ranks | tokens | peak MB/rank | planned MB | planned/measured | tokens/s |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['row']} | {r['ranks']} | {r['tokens']} | error: {r['error'][-80:]!r} | | | |")
            continue
        planned = r.get("planned_mb")
        ratio = f"{planned / r['peak_mb']:.2f}" if planned else "-"
        lines.append(f"| {r['row']} | {r['ranks']} | {r['tokens']} | {r['peak_mb']:.0f} | "
                     f"{planned or 0:.0f} | {ratio} | {r['tokens_per_second']:.0f} |")
    lines.append("")
    lines.append(f"budget per rank: {figs['budget_mib']:.0f} MiB" if figs["budget_mib"] else "budget: none")
    for cp, t in figs["longest_tokens"].items():
        ratio = figs["longest_ratio"].get(cp)
        lines.append(f"CP {cp}: {figs['mb_per_token'][cp] * 1024:.1f} KiB per token; longest within the budget "
                     f"≈ {t} tokens" + (f" ({ratio:.2f}× CP 1)" if ratio else ""))
    for tokens, s in figs["cp2_over_dp2_tokens_per_second"].items():
        lines.append(f"{tokens} tokens: CP 2 runs at {s:.2f}× DP 2's tokens/s")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--lengths", default="2048,4096,8192")
    parser.add_argument("--cp", default="1,2", help="context-parallel sizes (N processes each)")
    parser.add_argument("--dp", default="2", help="data-parallel rows (processes, one record each), '' for none")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--budget-mib", type=float, default=None)
    parser.add_argument("--timeout", type=int, default=1800)
    parser.add_argument("--quick", action="store_true", help="lengths 256,512; results under bench/.cache/")
    args = parser.parse_args()
    if args.quick:
        args.lengths = "256,512"
    cache = HERE / ".cache"
    cache.mkdir(exist_ok=True)
    model = make_model(args.layers, cache)
    lengths = [int(x) for x in args.lengths.split(",")]
    plan = [("cp", int(n)) for n in args.cp.split(",") if n] + [("dp", int(n)) for n in args.dp.split(",") if n]
    rows = []
    for tokens in lengths:
        for kind, n in plan:
            rows.append(row(kind, n, tokens, model, cache, args))
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "command"}), flush=True)
    figs = figures(rows, args.budget_mib)
    print(table(rows, figs))
    target = (cache if args.quick else HERE / "results") / f"context-parallel-{args.layers}l.json"
    target.write_text(json.dumps({**run_record(), "layers": args.layers, "model": "SmolLM2-135M shape",
                                  "rows": rows, "figures": figs}, indent=1) + "\n")
    print(f"wrote {target}")


if __name__ == "__main__":
    main()
