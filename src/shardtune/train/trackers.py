"""Experiment trackers (``--report-to tensorboard,wandb,mlflow``): what metrics.jsonl gets, from rank 0.

Each tracker gets the resolved config at the start, every optimizer step's numeric metrics, and the
final summary. ``--resume`` continues the same tracker run: the W&B and MLflow run ids are kept in
``OUT/trackers.json``, and TensorBoard drops the events of the steps a resumed run redoes. Their
libraries are optional extras (``pip install 'shardtune[trackers]'``); one asked for but missing is
an error before any worker starts (``check_installed``).

Where they write: TensorBoard under ``OUT/tensorboard``; W&B under ``OUT/wandb`` (project from
``WANDB_PROJECT``, default "shardtune"; ``WANDB_MODE=offline`` works as usual); MLflow to
``MLFLOW_TRACKING_URI`` or else a local SQLite store ``OUT/mlflow.db`` (MLflow 3 retired the
plain file store) (experiment from
``MLFLOW_EXPERIMENT_NAME``, default "shardtune").
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import uuid
from pathlib import Path
from typing import Any

from shardtune.config import ConfigError

#: tracker name: (module to import, pip package)
TRACKERS = {"tensorboard": ("torch.utils.tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"),
            "mlflow": ("mlflow", "mlflow")}


def parse_report_to(value: str | None) -> list[str]:
    """The tracker names in ``--report-to`` (comma-separated; empty or 'none': no tracker)."""
    names = [n.strip().lower() for n in (value or "").split(",") if n.strip()]
    if names in ([], ["none"]):
        return []
    unknown = [n for n in names if n not in TRACKERS]
    if unknown:
        raise ConfigError(f"option 'report-to': unknown tracker {', '.join(unknown)}; "
                          f"choose from {', '.join(TRACKERS)} (comma-separated)")
    return list(dict.fromkeys(names))


def check_installed(value: str | None) -> None:
    """Fail now, before training, when a tracker asked for is not installed."""
    for name in parse_report_to(value):
        module, package = TRACKERS[name]
        needed = {module.split(".")[0], package}  # torch.utils.tensorboard also needs the tensorboard package
        if any(importlib.util.find_spec(m) is None for m in needed):
            raise ConfigError(f"option 'report-to': {name} is not installed: pip install {package} "
                              "(or shardtune[trackers])")
    if "wandb" in parse_report_to(value):
        check_wandb_login()


def check_wandb_login() -> None:
    """wandb online without a login fails in rank 0 after the model is loaded, with wandb's traceback."""
    import netrc
    import os

    if os.environ.get("WANDB_MODE", "").lower() in ("offline", "disabled", "dryrun") or os.environ.get("WANDB_API_KEY"):
        return
    host = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai").split("://")[-1].split("/")[0]
    try:
        found = netrc.netrc(os.environ.get("NETRC")).authenticators(host)
    except (OSError, netrc.NetrcParseError):
        found = None
    if not found:
        raise ConfigError("option 'report-to': wandb has no login on this machine (no WANDB_API_KEY, no ~/.netrc "
                          f"entry for {host}): run `wandb login`, or set WANDB_MODE=offline to log locally "
                          "(`wandb sync` uploads it later)")


def mlflow_store(out: Path) -> str:
    """The local MLflow store of a run without MLFLOW_TRACKING_URI: ``mlflow ui --backend-store-uri`` it."""
    return f"sqlite:///{(out / 'mlflow.db').resolve()}"


def _numbers(record: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in record.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and k != "step"}


class Trackers:
    """The trackers of one run; on ranks other than 0 every call does nothing."""

    def __init__(self, report_to: str | None, config: dict[str, Any] | None, out: Path, enabled: bool,
                 resume_from_step: int = 0, continue_run: bool = False) -> None:
        """``continue_run``: add to the run whose ids ``OUT/trackers.json`` holds (``shardtune eval`` of a
        finished fine-tune), keeping every event it has; ``config`` None logs no config."""
        self.names = parse_report_to(report_to) if enabled else []
        self.out = out
        self._tb = self._wandb = self._mlflow = None
        if not self.names:
            return
        ids_file = out / "trackers.json"
        ids = json.loads(ids_file.read_text()) if (resume_from_step or continue_run) and ids_file.is_file() else {}
        if "tensorboard" in self.names:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step drops events of the steps the resumed run redoes: one curve, no overlap.
            purge = resume_from_step + 1 if resume_from_step else None
            self._tb = SummaryWriter(str(out / "tensorboard"), purge_step=purge)
            if config is not None:
                self._tb.add_text("config", "\n".join(f"    {k}: {v}" for k, v in config.items()), 0)
        if "wandb" in self.names:
            import wandb

            ids.setdefault("wandb", uuid.uuid4().hex[:12])
            (out / "wandb").mkdir(parents=True, exist_ok=True)
            self._wandb = wandb.init(project=os.environ.get("WANDB_PROJECT", "shardtune"), name=out.name,
                                     id=ids["wandb"], resume="allow", dir=str(out), config=config)
        if "mlflow" in self.names:
            import mlflow

            uri = os.environ.get("MLFLOW_TRACKING_URI")
            mlflow.set_tracking_uri(uri or mlflow_store(out))
            experiment = os.environ.get("MLFLOW_EXPERIMENT_NAME", "shardtune")
            if not uri and mlflow.get_experiment_by_name(experiment) is None:
                # A SQLite store puts artifacts under ./mlruns of the current directory unless told:
                # the run's summary.json belongs in OUT, not wherever the user started shardtune.
                mlflow.create_experiment(experiment, artifact_location=(out / "mlflow-artifacts").resolve().as_uri())
            mlflow.set_experiment(experiment)
            run = mlflow.start_run(run_id=ids.get("mlflow"), run_name=None if "mlflow" in ids else out.name)
            if "mlflow" not in ids and config is not None:
                mlflow.log_params({k: "" if v is None else v for k, v in config.items()})
            ids["mlflow"] = run.info.run_id
            self._mlflow = mlflow
        out.mkdir(parents=True, exist_ok=True)
        ids_file.write_text(json.dumps(ids, indent=2) + "\n")

    def log(self, record: dict[str, Any]) -> None:
        """One optimizer step's record (the metrics.jsonl line); ``record['step']`` is the x axis."""
        if not self.names:
            return
        step, values = int(record["step"]), _numbers(record)
        if self._tb:
            for k, v in values.items():
                self._tb.add_scalar(f"train/{k}" if k != "val_loss" else "val/loss", v, step)
        if self._wandb:
            self._wandb.log(values, step=step)
        if self._mlflow:
            self._mlflow.log_metrics(values, step=step)

    def log_results(self, values: dict[str, float], step: int) -> None:
        """Named results (an evaluation's), at ``step`` (the fine-tune's last) where the tracker takes one."""
        if not self.names:
            return
        values = _numbers(values)
        if self._tb:
            for k, v in values.items():
                self._tb.add_scalar(k, v, step)
        if self._wandb:  # a resumed W&B run refuses steps below its last one: no step, and in the summary
            self._wandb.log(values)
            self._wandb.summary.update(values)
        if self._mlflow:
            self._mlflow.log_metrics(values, step=step)

    def finish(self, summary: dict[str, Any] | None, failed: bool = False) -> None:
        """Record the final summary (when there is one) and close every tracker."""
        if not self.names:
            return
        numbers = _numbers(summary or {})
        if self._tb:
            if summary:
                self._tb.add_text("summary", "\n".join(f"    {k}: {v}" for k, v in summary.items()), 0)
            self._tb.close()
        if self._wandb:
            self._wandb.summary.update({f"final/{k}": v for k, v in numbers.items()})
            self._wandb.finish(exit_code=1 if failed else 0)
        if self._mlflow:
            if summary:
                self._mlflow.log_dict(summary, "summary.json")
                self._mlflow.log_metrics({f"final_{k}": v for k, v in numbers.items()})
            self._mlflow.end_run(status="FAILED" if failed else "FINISHED")
        self.names = []
