"""Plots and a one-page Markdown summary of a fine-tune's output directory: `shardtune report OUT_DIR`.

Reads OUT_DIR/metrics.jsonl (required) and OUT_DIR/summary.json (optional: an interrupted run has
none) and writes next to them:
  loss.png        training loss by step, validation loss where it was measured
  throughput.png  tokens per second by step
  memory.png      peak memory per rank in each phase (load, train, save), grouped bars
  report.md       the key summary fields as a table, the plots, and the results of ``shardtune eval``
                  written into the folder (eval.json: --data; lm_eval.json: --tasks, base against adapter)
Plots are drawn on matplotlib Figure objects (Agg canvas), never through pyplot: no display is
needed and no global state is touched.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

from shardtune.errors import ShardtuneError, check_path, read_text
from shardtune.runtime.files import staged_file, write_text_atomic
from shardtune.train.metrics import read_metrics as read_records

PHASES = ("load", "train", "save")
# Summary fields worth a line in report.md, in order, with how to show them.
SUMMARY_ROWS = (
    ("strategy", "strategy"), ("world_size", "ranks"), ("steps", "steps"), ("tokens", "tokens"),
    ("train_loss_first", "train loss, first step"), ("train_loss_last", "train loss, last step"),
    ("val_loss", "validation loss"), ("tokens_per_second", "tokens / s"), ("load_seconds", "load time (s)"),
    ("wall_seconds", "wall time (s)"), ("load_peak_mb", "load peak MiB per rank"),
    ("train_peak_mb", "train peak MiB per rank"), ("save_peak_mb", "save peak MiB per rank"),
    ("total_params", "parameters"), ("trainable_params", "trainable parameters"), ("adapter", "adapter"),
)


class ReportError(ShardtuneError, ValueError):
    """The output directory cannot be reported on; the message names the file and why."""


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """One record per step, in step order; a step logged twice (a resumed run) keeps its last record. A
    last line cut off by an interrupted write is left out, with a note (train/metrics.py's reader)."""
    if not path.is_file():
        raise ReportError(f"{path} does not exist: give the --out directory of a fine-tune that ran at least one step")
    check_path(path, "metrics file", "file", error=ReportError)
    records, note = read_records(path, ReportError)
    if note:
        print(f"note: {note}", file=sys.stderr)
    by_step = {record["step"]: record for record in records}
    if not by_step:
        raise ReportError(f"{path} is empty: the run has not finished a step yet")
    return [by_step[s] for s in sorted(by_step)]


def read_summary(path: Path, what: str = "summary") -> dict[str, Any] | None:
    """A JSON object file of the run folder (``what``: the summary, or an evaluation's results), if present."""
    if not path.is_file():
        return None
    try:
        summary = json.loads(read_text(path, f"{what} file", ReportError))
    except json.JSONDecodeError as err:
        raise ReportError(f"{path}:{err.lineno}: not valid JSON: {err.msg}") from None
    if not isinstance(summary, dict):
        raise ReportError(f"{path}: expected a JSON object (a fine-tune's {what}), got {type(summary).__name__}")
    return summary


def _series(metrics: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) where ``key`` is a finite number; null marks NaN/inf in metrics.jsonl."""
    points = [(m["step"], m[key]) for m in metrics
              if isinstance(m.get(key), (int, float)) and math.isfinite(m[key])]
    return [s for s, _ in points], [v for _, v in points]


def _figure(title: str, ylabel: str):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4), dpi=100, layout="constrained")
    ax = fig.subplots()
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    return fig, ax


def plot_loss(metrics: list[dict], path: Path) -> None:
    fig, ax = _figure("Loss", "loss (mean over target tokens)")
    steps, loss = _series(metrics, "loss")
    ax.plot(steps, loss, label="train", marker="." if len(steps) < 50 else None)
    val_steps, val = _series(metrics, "val_loss")
    if val:
        ax.plot(val_steps, val, label="validation", marker="o", linestyle="--")
    if all(v > 0 for v in loss + val):
        # Log scale: the last steps (loss 0.01-0.1) are as readable as the first (loss 2-6).
        ax.set_yscale("log")
        ax.set_ylabel("loss (mean over target tokens, log scale)")
    ax.set_xlabel("step")
    ax.legend()
    fig.savefig(path, format="png")


def plot_throughput(metrics: list[dict], path: Path) -> None:
    fig, ax = _figure("Throughput", "tokens / s")
    steps, rate = _series(metrics, "tokens_per_second")
    ax.plot(steps, rate, marker="." if len(steps) < 50 else None)
    ax.set_xlabel("step")
    ax.set_ylim(bottom=0)
    fig.savefig(path, format="png")


def memory_by_phase(summary: dict) -> dict[str, list[float]]:
    """{phase: [peak MB of rank 0, rank 1, …]} for the phases summary.json has."""
    out = {}
    for phase in PHASES:
        values = summary.get(f"{phase}_peak_mb")
        if isinstance(values, list) and values:
            out[phase] = [v if isinstance(v, (int, float)) else 0.0 for v in values]
    return out


def plot_memory(phases: dict[str, list[float]], path: Path) -> None:
    fig, ax = _figure("Peak memory per rank", "MiB")
    ranks = max(len(v) for v in phases.values())
    width = 0.8 / len(phases)
    for k, (phase, values) in enumerate(phases.items()):
        xs = [r + (k - (len(phases) - 1) / 2) * width for r in range(len(values))]
        bars = ax.bar(xs, values, width, label=phase)
        ax.bar_label(bars, fmt="%.0f", fontsize=8)
    ax.set_xticks(range(ranks), [f"rank {r}" for r in range(ranks)])
    # Headroom above the tallest bar keeps the legend off the bars.
    ax.set_ylim(0, 1.25 * max((v for values in phases.values() for v in values), default=1) or 1)
    ax.legend(ncols=len(phases), loc="upper center")
    fig.savefig(path, format="png")


def _cell(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        # four significant digits: 7.91 s, 49.1 tok/s, loss 0.01234 (not 7.9100, 49.0963)
        return f"{value:.4g}" if abs(value) < 1000 else f"{value:,.0f}"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, list):
        return ", ".join(_cell(v) for v in value)
    return str(value).replace("|", "\\|")


def write_report(out_dir: str | Path) -> dict[str, Path]:
    """Write the plots and report.md into ``out_dir``; return {name: path} of what was written."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ReportError("shardtune report needs matplotlib: pip install 'shardtune[report]'") from None
    out = Path(out_dir)
    if not out.is_dir():
        raise ReportError(f"{out} is not a directory: give the --out directory of a fine-tune")
    metrics = read_metrics(out / "metrics.jsonl")
    summary = read_summary(out / "summary.json")
    written = {"loss": out / "loss.png", "throughput": out / "throughput.png"}
    phases = memory_by_phase(summary) if summary else {}
    if phases:
        written["memory"] = out / "memory.png"
    for name, draw in (("loss", lambda p: plot_loss(metrics, p)), ("throughput", lambda p: plot_throughput(metrics, p)),
                       ("memory", lambda p: plot_memory(phases, p))):
        if name in written:
            with staged_file(written[name]) as tmp:  # whole or not at all, also when interrupted
                draw(tmp)
    written["report"] = out / "report.md"
    write_text_atomic(written["report"], _markdown(out, metrics, summary, written))
    return written


def _markdown(out: Path, metrics: list[dict], summary: dict | None, plots: dict[str, Path]) -> str:
    lines = [f"# Fine-tune report: `{out.resolve().name}`", ""]
    if summary is None:
        last = metrics[-1]
        lines += ["No summary.json: the run did not finish. From metrics.jsonl:", "",
                  "| field | value |", "|---|---|", f"| steps logged | {len(metrics)} |",
                  f"| last step | {_cell(last.get('step'))} |", f"| last loss | {_cell(last.get('loss'))} |"]
    else:
        lines += ["| field | value |", "|---|---|"]
        for key, label in SUMMARY_ROWS:
            if key in summary:
                value = summary[key]
                if key == "strategy" and summary.get("strategy_reason"):
                    value = f"{value} ({summary['strategy_reason']})"
                lines.append(f"| {label} | {_cell(value)} |")
    lines.append("")
    titles = {"loss": "Loss by step", "throughput": "Tokens per second by step", "memory": "Peak memory per rank"}
    for name, title in titles.items():
        if name in plots:
            lines += [f"## {title}", "", f"![{title}]({plots[name].name})", ""]
    if "memory" not in plots:
        lines += ["(No per-rank memory plot: summary.json is missing or has no peak memory fields.)", ""]
    return "\n".join(lines + _evaluation(out))


def _base_and_adapter(title: str, data: dict, figures: dict[str, str]) -> list[str]:
    """A section of an evaluation's ``figures`` ({key: label}), base and + adapter side by side."""
    tuned = data.get("adapter_figures") or {}
    return [f"## {title}", "", "| figure | base | + adapter |", "|---|---|---|",
            *(f"| {label} | {_cell(data['base'].get(k))} | {_cell(tuned.get(k))} |" for k, label in figures.items()),
            ""]


def _evaluation(out: Path) -> list[str]:
    """The ``shardtune eval`` results saved in the run folder, if any."""
    from shardtune.tools.eval_results import DATA_METRICS, EVAL_FILE, HARNESS_FILE, PAIR_METRICS
    from shardtune.tools.harness import side_by_side_rows

    lines = []
    data = read_summary(out / EVAL_FILE, "evaluation results")
    if data is not None and isinstance(data.get("base"), dict) and "prompts" in data:  # rewards: base, adapter
        lines += _base_and_adapter(f"Reward evaluation on `{data.get('data')}` ({_cell(data.get('prompts'))} "
                                   "prompts, `shardtune eval --reward`)", data,
                                   {k: k for k in data["base"] if k != "samples"})
    elif data is not None and isinstance(data.get("base"), dict):  # preference pairs: base against adapter
        tuned = data.get("adapter_figures") or {}
        lines += _base_and_adapter(f"Preference evaluation on `{data.get('data')}` ({_cell(data.get('pairs'))} "
                                   "pairs, `shardtune eval --data`)", data,
                                   {k: k.replace("_", " ") for k in PAIR_METRICS if k in data["base"] or k in tuned})
    elif data is not None:
        which = "base + adapter" if data.get("adapter") else "base model"
        lines += [f"## Evaluation on `{data.get('data')}` ({which}, `shardtune eval --data`)", "",
                  "| metric | value |", "|---|---|"]
        lines += [f"| {k.replace('_', ' ')} | {_cell(data.get(k))} |" for k in DATA_METRICS if k in data]
        lines.append("")
    harness = read_summary(out / HARNESS_FILE, "lm-eval results")
    if harness is not None and isinstance(harness.get("results"), dict) and "base" in harness["results"]:
        header, *rows = side_by_side_rows(harness)
        lines += [f"## Benchmarks (lm-evaluation-harness, `shardtune eval --tasks`; limit: "
                  f"{_cell(harness.get('limit'))})", "", "| " + " | ".join(header) + " |",
                  "|" + "---|" * len(header), *("| " + " | ".join(r) + " |" for r in rows), ""]
    return lines
