"""How long a run takes to start its workers: forked from a warm starter against fresh interpreters.

    .venv/bin/python bench/startup.py [--runs 3] [--nproc 2]

A tiny random Llama (the tests' 2-layer one) trains 3 steps, so nearly all of a run is start-up: the
launcher's checks, the workers' imports of torch, transformers and peft, the rendezvous, loading and
saving. Each worker start (``SHARDTUNE_WORKER_START``: ``fresh``, or the default warm starter) runs in a
process of its own, twice over:

- ``shardtune finetune`` typed once (one command, one run: its starter is started for that run);
- ``--runs`` fine-tunes from one Python process (``shardtune.finetune``, as a notebook or a script runs
  several): the first starts the starter, the later ones fork from it;
- one fine-tune on ``--records`` records (a cold token cache: the launcher's checks read and tokenize them),
  warm, with the starter started once the cheap checks pass (preflight's ``prestart``) and, for comparison,
  only at the launch: the starter's imports overlap the reading, or follow it.

Prints seconds per run and writes bench/results/startup.json. Every run's final loss and peak must be
the same under both: the bench fails otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from record import run_record

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
from tiny import instruction_records, make_model, write_jsonl  # noqa: E402

FLAGS = ["--dtype", "fp32", "--steps", "3", "--batch-size", "4", "--seq-len", "64"]

SERIES = """
import json, sys, time
import shardtune
model, data, out, runs, nproc = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
results = []
for i in range(runs):
    started = time.perf_counter()
    summary = shardtune.finetune(dict(model=model, data=data, out=f"{out}/run{i}", dtype="fp32", steps=3,
                                      batch_size=4, seq_len=64), nproc=nproc)
    results.append({"seconds": time.perf_counter() - started, "loss": summary["train_loss_last"],
                    "peak_mb": summary["train_peak_mb"]})
print("RESULT " + json.dumps(results))
"""


PRESTART = """
import sys, time
import shardtune.preflight
if sys.argv[1] == "off":  # the starter starts at the launch, after every check
    shardtune.preflight.prestart = lambda parallel: None
from shardtune.cli import main
started = time.perf_counter()
code = main(sys.argv[2:])
print(f"RESULT {time.perf_counter() - started}")
raise SystemExit(code)
"""


def prestart_run(mode: str, model: Path, data: Path, out: Path, nproc: int, env: dict[str, str]) -> float:
    """Seconds from ``finetune``'s call to its end, the starter started at preflight (``on``) or at the launch."""
    done = subprocess.run([sys.executable, "-c", PRESTART, mode, "finetune", "--model", str(model), "--data",
                           str(data), "--out", str(out), "--nproc", str(nproc), *FLAGS],
                          env={**env, "SHARDTUNE_CACHE": str(out) + "-cache"}, check=True, capture_output=True,
                          text=True)
    return float(next(ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")).split()[1])


def one_command(model: Path, data: Path, out: Path, nproc: int, env: dict[str, str]) -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "shardtune", "finetune", "--model", str(model), "--data", str(data),
                    "--out", str(out), "--nproc", str(nproc), *FLAGS], env=env, check=True, capture_output=True)
    return time.perf_counter() - started


def series(model: Path, data: Path, out: Path, runs: int, nproc: int, env: dict[str, str]) -> list[dict]:
    done = subprocess.run([sys.executable, "-c", SERIES, str(model), str(data), str(out), str(runs), str(nproc)],
                          env=env, check=True, capture_output=True, text=True)
    line = next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--records", type=int, default=40000)
    parser.add_argument("--out", type=Path, default=HERE / "results" / "startup.json")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="startup-bench-"))
    model = make_model(work / "model", "llama", tied=True)
    data = write_jsonl(work / "train.jsonl", instruction_records(20))
    rows = {}
    for start in ("fresh", "warm"):
        env = {**os.environ, "SHARDTUNE_WORKER_START": start}
        command = one_command(model, data, work / f"{start}-cli", args.nproc, env)
        runs = series(model, data, work / start, args.runs, args.nproc, env)
        rows[start] = {"one_command_s": command, "runs_s": [r["seconds"] for r in runs],
                       "later_runs_median_s": statistics.median(r["seconds"] for r in runs[1:]) if len(runs) > 1
                       else None, "losses": [r["loss"] for r in runs], "peaks_mb": [r["peak_mb"] for r in runs]}
    big = write_jsonl(work / "big.jsonl", instruction_records(args.records))
    warm_env = {**os.environ, "SHARDTUNE_WORKER_START": "warm"}
    prestart = {mode: prestart_run(mode, model, big, work / f"prestart-{mode}", args.nproc, warm_env)
                for mode in ("off", "on")}
    fresh, warm = rows["fresh"], rows["warm"]
    if fresh["losses"] != warm["losses"]:
        raise SystemExit(f"the runs differ: losses {fresh['losses']} (fresh) against {warm['losses']} (warm)")
    print(f"{'worker start':<14} {'one command s':>14} {'1st of runs s':>14} {'later runs s':>13}   peak MiB a rank")
    for name, r in rows.items():
        print(f"{name:<14} {r['one_command_s']:14.1f} {r['runs_s'][0]:14.1f} {r['later_runs_median_s'] or 0:13.1f}"
              f"   {r['peaks_mb'][-1]}")
    ratios = {"one_command": warm["one_command_s"] / fresh["one_command_s"],
              "later_runs": (warm["later_runs_median_s"] / fresh["later_runs_median_s"]
                             if fresh["later_runs_median_s"] else None)}
    print("warm / fresh: " + ", ".join(f"{k} {v:.2f}" for k, v in ratios.items() if v is not None))
    ratios["prestart"] = prestart["on"] / prestart["off"]
    print(f"{args.records} records, cold token cache: starter started at the launch {prestart['off']:.1f} s, "
          f"at preflight {prestart['on']:.1f} s ({ratios['prestart']:.2f})")
    result = {**run_record(), "nproc": args.nproc, "runs": args.runs, "model": "tests/tiny.py llama, 2 layers",
              "flags": FLAGS, "rows": rows,
              "prestart": {"records": args.records, "at_launch_s": prestart["off"], "at_preflight_s": prestart["on"]},
              "ratios": ratios}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
