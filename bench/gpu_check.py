"""The checks behind bench/gpu_check.sh: its inputs, each row's verdict, and the results file.

    python bench/gpu_check.py env                       # the machine; which multi-rank mode applies
    python bench/gpu_check.py prepare CACHE [--quick]   # models and data, as KEY=path lines for the shell
    python bench/gpu_check.py check ROW --out RUN_DIR [--plan PLAN.json] [--expect key=value ...]
                                                        [--same-as OTHER_RUN_DIR]   # the same losses
    python bench/gpu_check.py check-json ROW FILE --keys k1,k2   # eval/generate/harness outputs
    python bench/gpu_check.py ballast --leave GiB       # hold all but GiB of the GPU until killed
    python bench/gpu_check.py collect RESULTS.jsonl OUT.json [--merge --order ROW,ROW]   # exit 1 on a FAIL
    python bench/gpu_check.py pending OUT.json ROW...   # the rows OUT.json does not hold as passed

Every verdict is one line, ``PASS row  numbers`` or ``FAIL row: why``, and one JSON line appended to
``$GPU_CHECK_RESULTS``: ``passed`` true (a ``skipped`` one too: not applicable to the machine), false,
or null (not run: ``problems`` says why, such as the budget of the session). Runs on a CPU too
(``GPU_CHECK_DEVICE=cpu``: the shell's --cpu-smoke), where the CUDA-only expectations (NCCL, CUDA peaks,
the planner against reserved memory) are left out.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

#: |planned - measured| / measured of a row's whole peak (torch's reserved memory plus what the GPU
#: holds outside it) must stay below this.
PLAN_BAND = float(os.environ.get("PLAN_BAND", "0.25"))
DEVICE = os.environ.get("GPU_CHECK_DEVICE", "cuda")
#: a run that must compute what another computed (only where tensors wait is different) matches its
#: loss and gradient norm at every step within this, relative: bf16 kernels on a GPU are not bitwise
#: deterministic, while a wrong saved tensor changes the gradient by far more
SAME_RUN_BAND = 0.02


def _results() -> Path | None:
    path = os.environ.get("GPU_CHECK_RESULTS")
    return Path(path) if path else None


def verdict(row: str, problems: list[str], numbers: dict) -> int:
    """Print the row's line and record it; the exit code the shell reads (0: pass)."""
    ok = not problems
    shown = "  ".join(f"{k} {_fmt(v)}" for k, v in numbers.items())
    print(f"PASS {row}  {shown}" if ok else f"FAIL {row}: {'; '.join(problems)}  [{shown}]", flush=True)
    if _results() is not None:
        with _results().open("a") as f:
            f.write(json.dumps({"row": row, "passed": ok, "problems": problems, **numbers}) + "\n")
    return 0 if ok else 1


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


# --- env ---------------------------------------------------------------------------------------------

def cmd_env(args: argparse.Namespace) -> int:
    import torch

    cuda = torch.cuda.is_available()
    lines = {"torch": torch.__version__, "cuda": torch.version.cuda or "none", "gpus": torch.cuda.device_count()}
    if cuda:
        props = torch.cuda.get_device_properties(0)
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
        lines.update(gpu=props.name, capability=f"{props.major}.{props.minor}",
                     memory_gib=round(props.total_memory / 2**30, 1), nccl=nccl)
    for module in ("flash_attn", "lm_eval", "torchao", "vllm"):
        try:
            __import__(module)
            lines[module] = "yes"
        except Exception:  # noqa: BLE001 - an import that fails for any reason is "not usable here"
            lines[module] = "no"
    gpus = lines["gpus"]
    lines["multi_rank"] = ("nccl, one rank per GPU" if gpus >= 2 else
                           "none: one GPU (NCCL refuses two ranks on one GPU, and shardtune has no gloo-over-CUDA "
                           "mode), so every row runs one rank (an NCCL group of one) and the two-ranks row checks "
                           "the refusal")
    for k, v in lines.items():
        print(f"{k}: {v}")
    if not cuda and not args.allow_cpu:
        print("FAIL env: torch sees no CUDA GPU", flush=True)
        return 1
    return 0


# --- inputs -------------------------------------------------------------------------------------------

def cmd_prepare(args: argparse.Namespace) -> int:
    from fake_model import make_checkpoint, make_data
    from speed import mixed_data

    from tiny import write_jsonl

    cache = Path(args.cache)
    cache.mkdir(parents=True, exist_ok=True)
    out = {"TINY": make_checkpoint("tiny", cache)}  # hidden 64: NF4-quantizable, 2 layers
    flash = cache / "llama-tiny-flash"  # the same model, asking transformers for flash-attention 2
    if not (flash / "config.json").is_file():
        shutil.copytree(out["TINY"], flash, dirs_exist_ok=True)
        config = json.loads((flash / "config.json").read_text())
        config["attn_implementation"] = "flash_attention_2"
        (flash / "config.json").write_text(json.dumps(config, indent=2))
    out["TINY_FLASH"] = flash
    if not args.quick:
        out["BIG"] = make_checkpoint("1.1b", cache)
    out["DATA"] = make_data(cache / "data-512.jsonl", n=256, seq_len=512)
    out["DATA_SHORT"] = make_data(cache / "data-128.jsonl", n=64, seq_len=128)
    out["DATA_MIXED"] = mixed_data(cache / "data-mixed.jsonl", n=256)
    examples = HERE.parent / "examples"
    out["PAIRS"] = examples / "zarnovia_pairs_train.jsonl"
    out["PAIRS_VAL"] = examples / "zarnovia_pairs_heldout.jsonl"
    tasks = cache / "tasks"  # a local lm-eval task: the GPU machine reaches no dataset hub
    tasks.mkdir(exist_ok=True)
    words = ["cat", "dog", "sun", "moon", "tree", "sea", "rock", "bird"]
    records = [{"question": f"which word is {w}?", "choices": [w, words[(i + 1) % 8]], "label": 0}
               for i, w in enumerate(words)]
    choice = write_jsonl(cache / "tiny_choice.jsonl", records)
    (tasks / "tiny_choice.yaml").write_text(
        f"task: tiny_choice\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {choice}\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: \"Q: {{question}}\\nA:\"\n"
        "doc_to_choice: \"{{choices}}\"\ndoc_to_target: label\nmetric_list:\n  - metric: acc\n")
    out["TASKS"] = tasks
    for k, v in out.items():
        print(f"{k}={v}")
    return 0


# --- a fine-tune's verdict -----------------------------------------------------------------------------

def _finite(*values) -> bool:
    return all(isinstance(v, (int, float)) and math.isfinite(v) for v in values)


def _metrics(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def _planned(plan: dict, summary: dict) -> dict | None:
    """The plan's row for the setting the run ran (strategy, checkpointing, offload)."""
    first = plan.get(summary["strategy"])
    if not first:
        return None
    for row in [first, *first.get("variants", [])]:
        if row.get("terms") and row["activation_checkpointing"] == summary["activation_checkpointing"] \
                and row["cpu_offload"] == summary["run_plan"]["cpu_offload"]:
            return row
    return None


def planner_numbers(plan: dict, summary: dict, problems: list[str]) -> dict:
    """The whole planned peak against the whole measured one: torch's max reserved (train) plus what
    the GPU held outside torch's allocator (summary's runtime_mb, from mem_get_info)."""
    row = _planned(plan, summary)
    if row is None:
        problems.append("the plan has no row for the setting that ran")
        return {}
    numbers = {"planned_mb": round(row["peak_mb"]), "planned_runtime_mb": round(row["terms"]["runtime"])}
    if summary["device"] != "cuda":
        peak = max(summary["train_peak_mb"])
        numbers.update(measured_mb=round(peak), planned_over_measured=round(row["peak_mb"] / peak, 3))
        return numbers
    reserved = max(summary["cuda_max_reserved_mb"]["train"])
    outside = max(summary["runtime_mb"])
    whole = reserved + outside
    numbers.update(reserved_mb=round(reserved), outside_torch_mb=round(outside), measured_mb=round(whole),
                   planned_over_measured=round(row["peak_mb"] / whole, 3))
    if abs(row["peak_mb"] - whole) > PLAN_BAND * whole:
        problems.append(f"planned {row['peak_mb']:.0f} MB, measured {whole:.0f} MB (reserved {reserved:.0f} + "
                        f"outside torch {outside:.0f}; band {PLAN_BAND:.0%})")
    return numbers


def same_steps(got: list[dict], want: list[dict], problems: list[str]) -> dict:
    """Each step's loss and gradient norm against another run's of the same batches."""
    if not want:
        problems.append("the run to compare with has no metrics.jsonl")
        return {}
    if len(got) != len(want):
        problems.append(f"{len(got)} steps against {len(want)} in the run to compare with")
    worst = 0.0
    for g, w in zip(got, want):
        for key in ("loss", "grad_norm"):
            a, b = g.get(key), w.get(key)
            if not _finite(a, b):
                problems.append(f"step {g.get('step')}: {key} {a} against {b}")
                continue
            off = abs(a - b) / max(abs(b), 1e-12)
            worst = max(worst, off)
            if off > SAME_RUN_BAND:
                problems.append(f"step {g.get('step')}: {key} {a:.6g} against {b:.6g} in the run to compare with")
    return {"worst_step_difference": round(worst, 5)}


def cmd_check(args: argparse.Namespace) -> int:
    run = Path(args.out)
    problems: list[str] = []
    summary_file = run / "summary.json"
    if not summary_file.is_file():
        return verdict(args.row, [f"no {summary_file} (see {args.log or 'the log'})"], {})
    s = json.loads(summary_file.read_text())
    numbers = {"strategy": s["strategy"], "ranks": s["world_size"], "dtype": s["dtype"], "backend": s["backend"],
               "micro_batch": s["micro_batch_size"], "ac": s["activation_checkpointing"],
               "loss": f"{s['train_loss_first']:.3f}->{s['train_loss_last']:.3f}" if _finite(
                   s["train_loss_first"], s["train_loss_last"]) else "not finite",
               "tokens_per_s": round(s["tokens_per_second"] or 0), "load_s": s["load_seconds"]}
    if s["device"] != DEVICE:
        problems.append(f"ran on {s['device']}, not {DEVICE}")
    if DEVICE == "cuda":
        if "nccl" not in s["backend"]:
            problems.append(f"backend {s['backend']}, not NCCL")
        allocated = max(s.get("cuda_max_allocated_mb", {}).get("train", [0]))
        reserved = max(s.get("cuda_max_reserved_mb", {}).get("train", [0]))
        numbers.update(max_allocated_mb=round(allocated), max_reserved_mb=round(reserved))
        if not 0 < allocated <= reserved:
            problems.append(f"CUDA peaks missing or inconsistent: allocated {allocated}, reserved {reserved}")
    if not _finite(s["train_loss_first"], s["train_loss_last"]):
        problems.append("the loss is not finite")
    elif args.loss_down and not s["train_loss_last"] < s["train_loss_first"]:
        problems.append(f"the loss did not go down: {s['train_loss_first']} -> {s['train_loss_last']}")
    for expected in args.expect:
        key, _, want = expected.partition("=")
        got = s.get(key) if key in s else s["run_plan"].get(key)
        if str(got).lower() != want.lower():
            problems.append(f"{key} is {got}, expected {want}")
    metrics = _metrics(run)
    for key in args.metric:
        if not metrics or key not in metrics[-1]:
            problems.append(f"metrics.jsonl has no {key}")
        else:
            numbers[key] = metrics[-1][key]
    if args.val and not _finite(s.get("val_loss")):
        problems.append(f"no finite val_loss ({s.get('val_loss')})")
    elif args.val:
        numbers["val_loss"] = round(s["val_loss"], 4)
    if args.budget_gib is not None and DEVICE == "cuda":
        whole = max(s["cuda_max_reserved_mb"]["train"]) + max(s["runtime_mb"])
        numbers["budget_mb"] = round(args.budget_gib * 1024)
        if whole > args.budget_gib * 1024:
            problems.append(f"the automatic choice used {whole:.0f} MB, above the {args.budget_gib:.1f} GiB left")
    if args.plan:
        numbers.update(planner_numbers(json.loads(Path(args.plan).read_text()), s, problems))
    if args.same_as:
        numbers.update(same_steps(metrics, _metrics(Path(args.same_as)), problems))
    return verdict(args.row, problems, numbers)


def cmd_check_json(args: argparse.Namespace) -> int:
    """An eval/generate/harness output: the file is there, non-empty, and holds the keys asked for, finite."""
    path = Path(args.file)
    if not path.is_file() or not path.read_text().strip():
        return verdict(args.row, [f"no output in {path}"], {})
    if not args.keys:
        return verdict(args.row, [], {"chars": len(path.read_text().strip())})
    doc = json.loads(path.read_text())
    numbers, problems = {}, []
    for dotted in args.keys:
        value = doc
        for part in dotted.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        if not _finite(value):
            problems.append(f"{dotted} is {value}")
        numbers[dotted] = value
    return verdict(args.row, problems, numbers)


def cmd_ballast(args: argparse.Namespace) -> int:
    """Take all but ``--leave`` GiB of GPU 0 and hold it until killed: the device limit the auto choice meets."""
    import torch

    free, _ = torch.cuda.mem_get_info(0)
    take = max(0, free - int(args.leave * 2**30))
    held = torch.empty(take, dtype=torch.uint8, device="cuda:0")
    print(f"ballast: holding {take / 2**30:.1f} GiB, {args.leave} GiB left", flush=True)
    Path(args.ready).write_text("ready\n")
    while True:
        time.sleep(1)
        held.sum  # noqa: B018 - keep it referenced


class BadResults(Exception):
    """A results file that cannot be read as rows: exit 2, naming it."""


def _load_rows(path: Path) -> list[dict]:
    """A results file's rows (none when it is not there); a clear error when it is not a list of rows."""
    if not path.is_file():
        return []
    try:
        rows = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise BadResults(f"gpu_check: {path} is not JSON ({e}); move it away to start afresh") from None
    if not isinstance(rows, list) or not all(isinstance(r, dict) and "row" in r for r in rows):
        raise BadResults(f"gpu_check: {path} is not a list of rows ({{\"row\": ..., \"passed\": ...}})")
    return rows


def _commit() -> str:
    """The short commit the rows were measured at: $GPU_CHECK_COMMIT (for a copy of the tree without
    its .git, such as the one a borrowed GPU machine gets), else git's, else "unknown"."""
    if os.environ.get("GPU_CHECK_COMMIT"):
        return os.environ["GPU_CHECK_COMMIT"]
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE.parent, capture_output=True,
                              text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return done.stdout.strip() if done.returncode == 0 and done.stdout.strip() else "unknown"


def pending(recorded: list[dict], rows: list[str]) -> list[str]:
    """The rows of ``rows`` that ``recorded`` does not hold as passed: those it records as failed or not
    run first, then those it does not hold at all, each group in the order of ``rows``."""
    verdicts = {r["row"]: r.get("passed") for r in recorded}
    return ([r for r in rows if r in verdicts and verdicts[r] is not True]
            + [r for r in rows if r not in verdicts])


def merge(old: list[dict], new: list[dict], order: list[str] | None = None) -> list[dict]:
    """The results file after a ``--pending`` run: each row's latest verdict. A row judged again replaces
    its old entry; a row not judged this time keeps its old one (also one that was not run again for
    the budget: its last verdict says more than "not run"). The row ``gpu_check`` (the overall limit)
    is about one run, so only this run's stays. Sorted by ``order`` when given, unknown rows last."""
    rows = {r["row"]: r for r in old if r["row"] != "gpu_check"}
    for r in new:
        if r.get("passed") is None and rows.get(r["row"], {}).get("passed") is not None:
            continue
        rows[r["row"]] = r
    if not order:
        return list(rows.values())
    rank = {name: i for i, name in enumerate(order)}
    return sorted(rows.values(), key=lambda r: rank.get(r["row"], len(rank)))


def cmd_collect(args: argparse.Namespace) -> int:
    """This run's rows (stamped with the commit and date) into OUT, or merged into it with ``--merge``;
    exit 1 when a row of this run failed or none was judged."""
    results, out = Path(args.results), Path(args.out)
    stamp = {"commit": _commit(), "date": time.strftime("%Y-%m-%d")}
    rows = [{**json.loads(line), **stamp} for line in results.read_text().splitlines() if line.strip()] \
        if results.is_file() else []
    written = merge(_load_rows(out), rows, args.order.split(",") if args.order else None) if args.merge else rows
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(written, indent=1) + "\n")
    failed = [r["row"] for r in rows if r["passed"] is False]
    not_run = [r["row"] for r in rows if r["passed"] is None]
    judged = len(rows) - len(not_run)
    print(f"{judged - len(failed)} of {judged} rows judged passed"
          + (f"; failed: {', '.join(failed)}" if failed else "")
          + (f"; not run: {', '.join(not_run)}" if not_run else ""))
    if args.merge:
        kept = [r for r in written if r["row"] != "gpu_check"]
        left = [r["row"] for r in kept if r.get("passed") is not True]
        print(f"{out}: {len(kept) - len(left)} of {len(kept)} rows passed"
              + (f"; still pending: {', '.join(left)}" if left else ""))
    return 1 if failed or not judged else 0


def cmd_pending(args: argparse.Namespace) -> int:
    print(" ".join(pending(_load_rows(Path(args.summary)), args.rows)))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("env")
    p.add_argument("--allow-cpu", action="store_true")
    p.set_defaults(func=cmd_env)
    p = sub.add_parser("prepare")
    p.add_argument("cache")
    p.add_argument("--quick", action="store_true")
    p.set_defaults(func=cmd_prepare)
    p = sub.add_parser("check")
    p.add_argument("row")
    p.add_argument("--out", required=True)
    p.add_argument("--log")
    p.add_argument("--plan")
    p.add_argument("--expect", action="append", default=[], help="KEY=VALUE of summary.json or its run_plan")
    p.add_argument("--metric", action="append", default=[], help="a key the last metrics.jsonl line must hold")
    p.add_argument("--val", action="store_true", help="a finite val_loss is expected")
    p.add_argument("--loss-down", action="store_true")
    p.add_argument("--budget-gib", type=float, help="the whole measured peak must stay below this")
    p.add_argument("--same-as", help="a run of the same batches whose losses and gradient norms this one must have")
    p.set_defaults(func=cmd_check)
    p = sub.add_parser("check-json")
    p.add_argument("row")
    p.add_argument("file")
    p.add_argument("--keys", action="append", default=[], help="a dotted key that must hold a finite number")
    p.set_defaults(func=cmd_check_json)
    p = sub.add_parser("ballast")
    p.add_argument("--leave", type=float, required=True)
    p.add_argument("--ready", required=True)
    p.set_defaults(func=cmd_ballast)
    p = sub.add_parser("collect")
    p.add_argument("results")
    p.add_argument("out")
    p.add_argument("--merge", action="store_true", help="merge into OUT: a row judged again replaces its entry")
    p.add_argument("--order", help="ROW,ROW,...: the order of the merged rows")
    p.set_defaults(func=cmd_collect)
    p = sub.add_parser("pending")
    p.add_argument("summary", help="a results file (bench/results/gpu_check.json)")
    p.add_argument("rows", nargs="*")
    p.set_defaults(func=cmd_pending)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except BadResults as e:
        print(e, file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
