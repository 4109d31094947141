"""Where ``shardtune eval``'s results go besides the terminal: the run folder and its trackers.

The run folder of an evaluation is the fine-tune's ``--out`` directory: the parent of ``--adapter``
when it holds the fine-tune's ``config.yaml``, else the folder of an explicit ``--out FILE``. Its
results are written there (``lm_eval.json`` for ``--tasks``, ``eval.json`` for ``--data``), which
``shardtune report`` shows, and, with ``--report-to``, sent to the trackers of that run: W&B and
MLflow continue the fine-tune's run (ids in ``OUT/trackers.json``), TensorBoard adds to
``OUT/tensorboard``, at the fine-tune's last step. Names: ``lm_eval/{base|adapter}/TASK/METRIC`` and
``eval/{base|adapter}/DATA/METRIC`` (DATA: the data file's name without suffix).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from shardtune.errors import InputError
from shardtune.runtime.files import write_text_atomic
from shardtune.runtime.outputs import check_output, claim_output

HARNESS_FILE = "lm_eval.json"
EVAL_FILE = "eval.json"
DATA_METRICS = ("loss", "perplexity", "exact_match", "contains_match")
#: A preference evaluation's figures (the base's and the adapter's; the reward ones: the adapter's only).
PAIR_METRICS = ("accuracy", "mean_margin", "reward_accuracy", "reward_margin")


def run_folder_of(adapter: str | Path | None) -> Path | None:
    """The fine-tune's output directory of ``adapter`` (OUT_DIR of OUT_DIR/adapter), if it is one."""
    if adapter and (Path(adapter).parent / "config.yaml").is_file():
        return Path(adapter).parent
    return None


def default_out(adapter: str | Path | None, name: str) -> Path | None:
    folder = run_folder_of(adapter)
    return folder / name if folder else None


def check_report_to(report_to: str | None, out: Path | None) -> None:
    """Before any model is loaded: the trackers are installed and there is a run folder for them."""
    from shardtune.train.trackers import check_installed, parse_report_to

    if not parse_report_to(report_to):
        return
    check_installed(report_to)
    if out is None:
        raise InputError("shardtune eval --report-to needs a run folder for the trackers: give --adapter "
                         "OUT_DIR/adapter of a fine-tune, or --out FILE (its folder is used)")


def check_out(out: Path | None, model: str | Path, adapter: str | Path | None, data: str | Path | None) -> None:
    """Before any model is loaded: ``out`` is no input and lies in no rotated folder (runtime/outputs.py).
    An existing results file is replaced: each evaluation writes its own."""
    if out is not None:
        check_output(out, kind="file", inputs=_inputs(model, adapter, data), overwrite=True, name="--out")


def _inputs(model: str | Path, adapter: str | Path | None, data: str | Path | None):
    return (("model directory", model), ("adapter", adapter), ("data", data))


def write_json(out: Path, result: dict[str, Any]) -> None:
    """``out`` written whole or not at all, by one writer at a time (the inputs were checked by ``check_out``)."""
    with claim_output(out, kind="file", command="eval", overwrite=True, name="--out"):
        write_text_atomic(out, json.dumps(result, indent=2, default=str) + "\n")


def _key(text: str) -> str:
    """A name every tracker accepts (MLflow: letters, digits, _ - . / and space)."""
    return re.sub(r"[^\w\-./ ]", "_", text)


def harness_values(report: dict) -> dict[str, float]:
    """lm_eval/{label}/{task}/{metric} for each numeric metric (no stderr); the filter when not 'none'."""
    values = {}
    for label, tasks in report["results"].items():
        for task, metrics in tasks.items():
            for key, value in metrics.items():
                metric, _, kind = key.partition(",")
                if isinstance(value, (int, float)) and not isinstance(value, bool) and "stderr" not in metric:
                    name = metric if kind in ("", "none") else f"{metric}_{kind}"
                    values[_key(f"lm_eval/{label}/{task}/{name}")] = float(value)
    return values


def data_values(result: dict, data: str, adapter: str | None) -> dict[str, float]:
    label, stem = "adapter" if adapter else "base", Path(data).stem
    return {_key(f"eval/{label}/{stem}/{k}"): result[k] for k in DATA_METRICS
            if isinstance(result.get(k), (int, float))}


def preference_values(result: dict, data: str) -> dict[str, float]:
    """eval/{base,adapter}/{data}/{figure} of a preference evaluation (tools/preference_eval.py)."""
    stem, values = Path(data).stem, {}
    for label, figures in (("base", result["base"]), ("adapter", result.get("adapter_figures") or {})):
        values.update({_key(f"eval/{label}/{stem}/{k}"): float(v) for k, v in figures.items() if k in PAIR_METRICS})
    return values


def reward_values(result: dict, data: str) -> dict[str, float]:
    """eval/{base,adapter}/{data}/{figure} of a reward evaluation (tools/reward_eval.py): its numbers, those it
    has (a mean no completion was scored for is None)."""
    stem, values = Path(data).stem, {}
    for label, figures in (("base", result["base"]), ("adapter", result.get("adapter_figures") or {})):
        values.update({_key(f"eval/{label}/{stem}/{k}"): float(v) for k, v in figures.items()
                       if isinstance(v, (int, float)) and not isinstance(v, bool)})
    return values


def send(report_to: str | None, folder: Path, values: dict[str, float]) -> None:
    """Add ``values`` to the run's trackers, at the fine-tune's last step (0 without summary.json)."""
    from shardtune.train.trackers import Trackers, parse_report_to

    if not parse_report_to(report_to):
        return
    step = 0
    try:
        step = int(json.loads((folder / "summary.json").read_text()).get("steps") or 0)
    except (OSError, ValueError, AttributeError):
        pass  # not a finished fine-tune's folder: the results go at step 0
    trackers = Trackers(report_to, None, folder, enabled=True, continue_run=True)
    try:
        trackers.log_results(values, step)
    finally:
        trackers.finish(None)
