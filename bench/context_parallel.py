"""Context parallelism: how much longer a context the same per-rank memory holds with --context-parallel N,
what it costs in speed against data parallelism, and how close the planner is.

    nice -n 10 python bench/context_parallel.py                       # 2 layers: 2k, 4k, 8k tokens; CP 1, 2, DP 2
    python bench/context_parallel.py --layers 4 --lengths 4096,8192,16384 --cp 1,2,4
    python bench/context_parallel.py --quick                          # tiny lengths: the pipeline in a minute
    nice -n 10 python bench/context_parallel.py --memory-only \
        --grid "1:4096,8192,16384 2:8192,16384,32768 4:16384,32768"  # peaks only, lengths per CP size

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

Figures: per CP size, the longest context within the per-rank budget (``--budget-mib``; default: CP 1's
peak at its longest length, so CP 1's longest is that length), read off the CP size's measured peaks joined
point to point (interpolated between the two rows around the budget; beyond the longest row, the last two
rows' line carries on and ``extrapolated`` says how far, as a multiple of the longest row), with its ratio to
CP 1's (issue 33's targets: ≥ 1.8× at CP 2, ≥ 3.4× at CP 4), and the peak's growth per token between the two
longest rows; tokens/s of CP 2 over DP 2 at each length both ran (target ≥ 0.85); planner over measured, per
row (target within ±10%).

``--memory-only`` measures peaks alone (one step a row, no DP rows, no speed figure): ``--grid`` then gives
each CP size its own lengths, so that every size reaches the budget at lengths it can run.
Writes bench/results/context-parallel-<layers>l.json, ``--memory-only`` context-parallel-memory-<layers>l.json,
after every row (``--quick``: bench/.cache/).
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
from record import git_commit, plan_flags, replan_record, run_record  # noqa: E402


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
                 loss_first=summary["train_loss_first"])
    if not args.memory_only:  # one step on a shared machine: no speed to speak of
        entry["tokens_per_second"] = sum(s["tokens"] for s in timed) / sum(s["seconds"] for s in timed)
    return {**entry, **planned(base, args.timeout)}


def planned(flags: list[str], timeout: int) -> dict:
    """``shardtune plan --json``'s peak for a row's finetune flags: {"planned_mb"}, or {"plan_error"}."""
    done = shardtune("plan", *flags, "--json", timeout=timeout)
    if done.returncode:
        return {"plan_error": (done.stderr or done.stdout)[-500:]}
    return {"planned_mb": json.loads(done.stdout)[flags[flags.index("--strategy") + 1]]["peak_mb"]}


def longest_within(points: list[tuple[int, float]], budget: float) -> tuple[float, float] | None:
    """(tokens, extrapolated) where the peaks ``points`` (tokens, MB), joined point to point, reach ``budget``:
    interpolated between the rows around it (``extrapolated`` 1.0), or beyond the longest row along the last two
    rows' line (``extrapolated``: the tokens over the longest row's). None under two points, or where the peaks
    do not grow."""
    points = sorted(points)
    if len(points) < 2:
        return None
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if y0 <= budget <= y1 and y1 > y0:
            return x0 + (budget - y0) * (x1 - x0) / (y1 - y0), 1.0
    (x0, y0), (x1, y1) = points[-2:]
    if budget < points[0][1] or y1 <= y0:
        return None
    tokens = x1 + (budget - y1) * (x1 - x0) / (y1 - y0)
    return tokens, tokens / x1


def figures(rows: list[dict], budget: float | None) -> dict:
    ok = [r for r in rows if "peak_mb" in r]
    cps = sorted({r["context_parallel"] for r in ok if r["kind"] == "cp"})
    points = {cp: sorted((r["tokens"], r["peak_mb"]) for r in ok if r["kind"] == "cp" and r["context_parallel"] == cp)
              for cp in cps}
    one = points.get(1, [])
    if budget is None and one:
        budget = one[-1][1]
    longest = {cp: found for cp, p in points.items() if budget and (found := longest_within(p, budget))}
    by_budget = []  # the same, with each CP 1 row's peak as the budget
    for tokens, peak in one:
        reach = {cp: found for cp, p in points.items() if (found := longest_within(p, peak))}
        by_budget.append({"cp1_tokens": tokens, "budget_mib": peak,
                          "longest_tokens": {cp: round(t) for cp, (t, _) in reach.items()},
                          "longest_ratio": {cp: t / tokens for cp, (t, _) in reach.items()},
                          "extrapolated": {cp: round(x, 2) for cp, (_, x) in reach.items()}})
    out: dict = {"budget_mib": budget, "by_budget": by_budget,
                 "mb_per_token": {cp: (p[-1][1] - p[-2][1]) / (p[-1][0] - p[-2][0])
                                  for cp, p in points.items() if len(p) > 1},
                 "longest_tokens": {cp: round(t) for cp, (t, _) in longest.items()},
                 "extrapolated": {cp: round(x, 2) for cp, (_, x) in longest.items()},
                 "longest_ratio": {cp: t / longest[1][0] for cp, (t, _) in longest.items() if 1 in longest}}
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
                     f"{planned or 0:.0f} | {ratio} | {r['tokens_per_second']:.0f} |" if "tokens_per_second" in r else
                     f"{planned or 0:.0f} | {ratio} | - |")
    lines.append("")
    lines.append(f"budget per rank: {figs['budget_mib']:.0f} MiB" if figs["budget_mib"] else "budget: none")
    for cp, t in figs["longest_tokens"].items():
        ratio, beyond = figs["longest_ratio"].get(cp), figs["extrapolated"][cp]
        lines.append(f"CP {cp}: {figs['mb_per_token'][cp] * 1024:.1f} KiB per token; longest within the budget "
                     f"≈ {t} tokens" + (f" ({ratio:.2f}× CP 1)" if ratio else "")
                     + (f", extrapolated to {beyond:.2f}× its longest row" if beyond > 1 else ""))
    for tokens, s in figs["cp2_over_dp2_tokens_per_second"].items():
        lines.append(f"{tokens} tokens: CP 2 runs at {s:.2f}× DP 2's tokens/s")
    return "\n".join(lines)


def grid(args: argparse.Namespace) -> list[tuple[int, str, int]]:
    """(tokens, kind, processes) of every row, shortest first (a run cut short keeps the cheap rows)."""
    if args.grid:
        plan = [(int(t), "cp", int(n)) for part in args.grid.split() for n, _, lengths in [part.partition(":")]
                for t in lengths.split(",") if t]
    else:
        kinds = [("cp", int(n)) for n in args.cp.split(",") if n]
        kinds += [("dp", int(n)) for n in args.dp.split(",") if n and not args.memory_only]
        plan = [(int(t), kind, n) for t in args.lengths.split(",") for kind, n in kinds]
    return sorted(plan, key=lambda r: r[0])


def save(target: Path, args: argparse.Namespace | dict, rows: list[dict], figs: dict, note: str | None) -> None:
    """The result file: ``args`` gives layers and steps (or, on --replan, the earlier file's record)."""
    head = ({**run_record(), "layers": args.layers, "model": "SmolLM2-135M shape", "steps": args.steps}
            if isinstance(args, argparse.Namespace) else {k: args[k] for k in args if k not in ("rows", "figures")})
    target.write_text(json.dumps({**head, "rows": rows, "figures": figs, **({"note": note} if note else {})},
                                 indent=1) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--lengths", default="2048,4096,8192")
    parser.add_argument("--cp", default="1,2", help="context-parallel sizes (N processes each)")
    parser.add_argument("--dp", default="2", help="data-parallel rows (processes, one record each), '' for none")
    parser.add_argument("--grid", default="", help="CP rows as 'N:LEN,LEN N:LEN,...' (instead of --lengths and --cp)")
    parser.add_argument("--memory-only", action="store_true", help="peaks only: one step, no DP rows, "
                        "results in context-parallel-memory-<layers>l.json")
    parser.add_argument("--steps", type=int, default=None, help="steps per row [default: 2; 1 with --memory-only]")
    parser.add_argument("--budget-mib", type=float, default=None)
    parser.add_argument("--timeout", type=int, default=1800)
    parser.add_argument("--quick", action="store_true", help="lengths 256,512; results under bench/.cache/")
    parser.add_argument("--add", action="store_true", help="keep the result file's rows, add these")
    parser.add_argument("--replan", action="store_true", help="run no job: predict the result file's rows again "
                        "with the planner as it is now (with --memory-only: that file)")
    args = parser.parse_args()
    if args.steps is None:
        args.steps = 1 if args.memory_only else 2
    if args.quick:
        args.lengths = "256,512"
    cache = HERE / ".cache"
    cache.mkdir(exist_ok=True)
    model = make_model(args.layers, cache)
    stem = f"context-parallel-{'memory-' if args.memory_only else ''}{args.layers}l.json"
    target = (cache if args.quick else HERE / "results") / stem
    if args.replan and not target.is_file():
        parser.error(f"--replan predicts the measured rows of {target} again: no such file")
    earlier = json.loads(target.read_text()) if (args.add or args.replan) and target.is_file() else {}
    rows, note = earlier.get("rows", []), earlier.get("note")  # a note on how the rows were measured stays
    if args.replan:  # no job: each measured row predicted again by the planner as it is now
        for r in rows:
            r.update(planned(plan_flags(r["command"], model), args.timeout))
            if "planned_mb" in r:
                r["planned_at"] = git_commit()
        figs = figures(rows, args.budget_mib)
    for tokens, kind, n in ([] if args.replan else grid(args)):
        rows.append(row(kind, n, tokens, model, cache, args))
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "command"}), flush=True)
        figs = figures(rows, args.budget_mib)
        save(target, args, rows, figs, note)
    if args.replan:
        save(target, {**earlier, "replanned": replan_record()}, rows, figs, note)  # the measurement's own record stays
    print(table(rows, figs))
    print(f"wrote {target}")


if __name__ == "__main__":
    main()
