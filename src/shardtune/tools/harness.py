"""Standard benchmarks through EleutherAI's lm-evaluation-harness, base and base + adapter side by side.

The models are loaded as ``shardtune generate`` loads them (``generate.load_model``: the adapter
through peft, the base in NF4 with ``--quantize nf4``, as a QLoRA fine-tune saw it) and handed to the
harness's own ``HFLM`` as ready models, so the harness's task definitions, prompts and metrics are
used unchanged. One process evaluates one model at a time: a model that does not fit one process is
not covered here.

Offline, task data comes from the datasets cache; a task whose data is not there is an error that
names the task. ``include_path`` adds a folder of task YAML files (the harness's custom tasks, e.g.
``dataset_path: json`` with ``dataset_kwargs: {data_files: ...}`` over a local JSONL).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from shardtune.errors import ShardtuneError
from shardtune.tools.eval_results import write_json

if TYPE_CHECKING:
    from shardtune.tools.generate import EvalModel

log = logging.getLogger("shardtune")


class HarnessError(ShardtuneError, ValueError):
    """A task cannot be run: unknown name, data not cached offline, lm-eval missing; names the task."""


def _tasks(names: list[str], include_path: str | None):
    try:
        from lm_eval.tasks import TaskManager, get_task_dict
    except ImportError:
        raise HarnessError("--tasks needs lm-evaluation-harness: pip install 'shardtune[eval]' "
                           "(or pip install lm-eval)") from None
    manager = TaskManager(include_path=include_path) if include_path else TaskManager()
    unknown = [n for n in names if n not in manager.all_tasks]
    if unknown:
        where = f" (nor in --include-path {include_path})" if include_path else ""
        raise HarnessError(f"--tasks: {', '.join(unknown)} is not a task lm-eval knows{where}; "
                           "`lm_eval ls tasks` lists them")
    try:
        return manager, get_task_dict(names, manager)
    except Exception as err:  # noqa: BLE001 - datasets raises many kinds when the data is not at hand
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise HarnessError(f"--tasks {','.join(names)}: the task data could not be loaded ({reason}). Offline, "
                           "lm-eval reads the datasets cache: run once with network access (or copy the cache) "
                           "to cache it") from None


@dataclass(frozen=True)
class Tasks:
    """The lm-eval tasks to run: their names, and how (``--limit``, ``--num-fewshot``, ``--include-path``)."""

    names: list[str]
    limit: int | None = None
    num_fewshot: int | None = None
    include_path: str | None = None


def run_tasks(subject: EvalModel, tasks: Tasks, batch_size: int = 8, out: str | Path | None = None) -> dict:
    """{"base": results, "adapter": results (with an adapter)} of ``subject``, also written to ``out``
    (a JSON file)."""
    from lm_eval import evaluator
    from lm_eval.models.huggingface import HFLM

    manager, _ = _tasks(tasks.names, tasks.include_path)  # fail before loading any model
    adapter = subject.adapter
    runs = {"base": None, **({"adapter": adapter} if adapter else {})}
    report: dict = {"model": str(subject.model), "adapter": str(adapter) if adapter else None, "tasks": tasks.names,
                    "limit": tasks.limit, "num_fewshot": tasks.num_fewshot, "quantize": subject.quantize,
                    "results": {}}
    for label, which in runs.items():
        lm_model, tokenizer = dataclasses.replace(subject, adapter=which).load()
        lm = HFLM(pretrained=lm_model, tokenizer=tokenizer, batch_size=batch_size)
        result = evaluator.simple_evaluate(model=lm, tasks=tasks.names, limit=tasks.limit,
                                           num_fewshot=tasks.num_fewshot, task_manager=manager, log_samples=False,
                                           bootstrap_iters=0)
        report["results"][label] = result["results"]
        report.setdefault("table", {})[label] = _make_table(result)
        del lm, lm_model
    if out is not None:
        write_json(Path(out), report)
        report["out"] = str(out)
    return report


def _make_table(result: dict) -> str:
    from lm_eval.utils import make_table

    return make_table(result)


def side_by_side_rows(report: dict) -> list[tuple[str, ...]]:
    """The header and one row per task and metric: the base's value, the adapter's, and the difference."""
    base = report["results"]["base"]
    tuned = report["results"].get("adapter")
    rows = [("task", "metric", "base", *(("adapter", "delta") if tuned else ()))]
    for task, metrics in base.items():
        for key, value in metrics.items():
            if not isinstance(value, (int, float)) or "stderr" in key or key == "alias":
                continue
            row = (task, key.split(",")[0], f"{value:.4f}")
            if tuned:
                other = tuned.get(task, {}).get(key)
                row += (f"{other:.4f}", f"{other - value:+.4f}") if isinstance(other, (int, float)) else ("-", "-")
            rows.append(row)
    return rows


def side_by_side(report: dict) -> str:
    rows = side_by_side_rows(report)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)
