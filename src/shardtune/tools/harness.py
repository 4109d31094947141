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
import glob
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from shardtune.errors import ShardtuneError, check_path, read_text
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
    if include_path:
        check_path(include_path, "--include-path", "dir", error=HarnessError)
        # tasks of the user's own: indexed alone, where lm-eval's thousands of task files take seconds
        own = TaskManager(include_path=include_path, include_defaults=False)
        # a cause in the user's own files is named before lm-eval's own tasks are indexed too: a missing local
        # data file of a task asked for, or a broken file that names a task not found there
        missing = [n for n in names if n not in own.all_tasks]
        check_task_files(include_path, names, missing, own_only=True)
        if not missing:
            try:
                return own, get_task_dict(names, own)
            except Exception:  # noqa: BLE001 - one that builds on lm-eval's own tasks: indexed with them, below
                pass
    manager = TaskManager(include_path=include_path) if include_path else TaskManager()
    unknown = [n for n in names if n not in manager.all_tasks]
    if include_path and unknown:  # lm-eval skips a file it cannot read (its task is then unknown); the data
        check_task_files(include_path, names, unknown)  # files of the tasks asked for were checked above
    if unknown:
        where = f" (nor in --include-path {include_path})" if include_path else ""
        raise HarnessError(f"--tasks: {', '.join(unknown)} is not a task lm-eval knows{where}; "
                           "`lm_eval ls tasks` lists them")
    try:
        return manager, get_task_dict(names, manager)
    except Exception as err:  # noqa: BLE001 - datasets raises many kinds when the data is not at hand
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise HarnessError(f"--tasks {','.join(names)}: the task data could not be loaded ({reason}). For data "
                           "from the Hub: offline, lm-eval reads the datasets cache; run once with network access "
                           "(or copy the cache) to cache it") from None


class _TaskLoader(yaml.SafeLoader):
    """YAML as lm-eval's task files write it: tags of their own (``!function utils.process_docs``) allowed."""


_TaskLoader.add_multi_constructor("!", lambda loader, suffix, node: None)


def check_task_files(include_path: str | Path, names: list[str], unknown: list[str], own_only: bool = False) -> None:
    """The task files under ``include_path``: while a task asked for is ``unknown``, one that is not valid YAML
    is named (lm-eval skipped it: most likely the task's own); the local ``data_files`` of the tasks asked
    for must exist (datasets' error for a missing local file reads as one about the network).
    ``own_only``: ``unknown`` are the tasks not in ``include_path`` (lm-eval's own tasks not indexed yet, where
    they may be), so only a broken file whose text names one of them is named."""
    for file in sorted(p for p in Path(include_path).rglob("*") if p.suffix in (".yaml", ".yml") and p.is_file()):
        text = read_text(file, "task file", HarnessError)
        try:
            task = yaml.load(text, Loader=_TaskLoader)
        except yaml.YAMLError as err:
            named = [n for n in unknown if not own_only or n in text]
            if not named:
                continue
            mark = getattr(err, "problem_mark", None)
            where = f"{file}:{mark.line + 1}" if mark else str(file)
            known = f"in --include-path {include_path}" if own_only else "lm-eval knows"
            raise HarnessError(f"--tasks: {', '.join(named)} is not a task {known}, and {where} is not valid "
                               f"YAML ({getattr(err, 'problem', None) or err}): lm-eval skipped that file; fix it "
                               "(is the task defined there?)") from None
        if not isinstance(task, dict) or task.get("task") not in names:
            continue
        for path in _local_files((task.get("dataset_kwargs") or {}).get("data_files")):
            if not glob.glob(str(Path(path).expanduser())):
                raise HarnessError(f"{file}: task {task['task']}'s data_files {path} does not exist (a local path: "
                                   f"relative ones start at the working directory, {Path.cwd()})")


def _local_files(data_files: object) -> list[str]:
    """The local paths among a task's ``data_files`` (a path, a list, or a mapping of split to either)."""
    values = data_files.values() if isinstance(data_files, dict) else [data_files]
    paths = [p for v in values for p in (v if isinstance(v, list) else [v]) if isinstance(p, str)]
    return [p for p in paths if "://" not in p]


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

    from shardtune.tools.generate import resolve_quantize

    manager, _ = _tasks(tasks.names, tasks.include_path)  # fail before loading any model
    subject = dataclasses.replace(subject, quantize=resolve_quantize(subject.quantize, subject.adapter))
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
