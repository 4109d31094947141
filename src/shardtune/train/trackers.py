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

A tracker that fails during the run (a full disk under ``OUT/tensorboard``, a tracking server gone)
is dropped with one warning naming it, where it writes and why; training goes on, and metrics.jsonl
keeps every step. A tracker is a view of the run, not the run: hours of training are not given up for it.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import uuid
from pathlib import Path
from typing import Any

from shardtune.config import ConfigError
from shardtune.runtime.failure import injected_full_disk
from shardtune.runtime.files import output_error

log = logging.getLogger("shardtune")

#: tracker name: (module to import, pip package)
TRACKERS = {"tensorboard": ("torch.utils.tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"),
            "mlflow": ("mlflow", "mlflow")}
_ATTRIBUTE = {"tensorboard": "_tb", "wandb": "_wandb", "mlflow": "_mlflow"}  # where Trackers holds each


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
            self._guard("tensorboard", resume_from_step, self._start_tensorboard, config, resume_from_step)
        if "wandb" in self.names:
            self._guard("wandb", resume_from_step, self._start_wandb, config, ids)
        if "mlflow" in self.names:
            self._guard("mlflow", resume_from_step, self._start_mlflow, config, ids)
        try:
            out.mkdir(parents=True, exist_ok=True)
            ids_file.write_text(json.dumps(ids, indent=2) + "\n")
        except OSError as err:
            raise output_error(err, ids_file) from None

    def _start_tensorboard(self, config: dict[str, Any] | None, resume_from_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # purge_step drops events of the steps the resumed run redoes: one curve, no overlap.
        purge = resume_from_step + 1 if resume_from_step else None
        self._tb = SummaryWriter(str(self.out / "tensorboard"), purge_step=purge)
        if config is not None:
            self._tb.add_text("config", "\n".join(f"    {k}: {v}" for k, v in config.items()), 0)

    def _start_wandb(self, config: dict[str, Any] | None, ids: dict[str, str]) -> None:
        import wandb

        ids.setdefault("wandb", uuid.uuid4().hex[:12])
        (self.out / "wandb").mkdir(parents=True, exist_ok=True)
        self._wandb = wandb.init(project=os.environ.get("WANDB_PROJECT", "shardtune"), name=self.out.name,
                                 id=ids["wandb"], resume="allow", dir=str(self.out), config=config)

    def _start_mlflow(self, config: dict[str, Any] | None, ids: dict[str, str]) -> None:
        import mlflow

        out = self.out
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

    def _where(self, name: str) -> str:
        if name == "mlflow":
            return os.environ.get("MLFLOW_TRACKING_URI") or mlflow_store(self.out)
        return str(self.out / name)

    def _guard(self, name: str, step: int, call, *args) -> None:
        """``call(*args)`` for tracker ``name``; when it fails, the tracker is dropped with one warning."""
        if name not in self.names:
            return
        try:
            injected_full_disk(name, step, self._where(name))
            call(*args)
        # Any failure of a tracker's library (its own exception classes, an OSError from its writer
        # thread) ends that tracker, never the training.
        except Exception as err:
            self.names.remove(name)
            if name == "tensorboard" and self._tb is not None:
                try:  # stop its writer thread; what it still holds cannot be written either
                    self._tb.close()
                except Exception:
                    pass
            setattr(self, _ATTRIBUTE[name], None)
            reason = str(output_error(err, self._where(name))) if isinstance(err, OSError) else \
                f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"
            log.warning("--report-to %s stopped working %s (%s): %s; training goes on without it, and "
                        "metrics.jsonl keeps every step", name, f"at step {step}" if step else "as it started",
                        self._where(name), reason)

    def log(self, record: dict[str, Any]) -> None:
        """One optimizer step's record (the metrics.jsonl line); ``record['step']`` is the x axis."""
        if not self.names:
            return
        step, values = int(record["step"]), _numbers(record)

        def tensorboard() -> None:
            for k, v in values.items():
                self._tb.add_scalar(f"train/{k}" if k != "val_loss" else "val/loss", v, step)

        self._guard("tensorboard", step, tensorboard)
        self._guard("wandb", step, lambda: self._wandb.log(values, step=step))
        self._guard("mlflow", step, lambda: self._mlflow.log_metrics(values, step=step))

    def log_results(self, values: dict[str, float], step: int) -> None:
        """Named results (an evaluation's), at ``step`` (the fine-tune's last) where the tracker takes one."""
        if not self.names:
            return
        values = _numbers(values)

        def tensorboard() -> None:
            for k, v in values.items():
                self._tb.add_scalar(k, v, step)

        def wandb() -> None:  # a resumed W&B run refuses steps below its last one: no step, and in the summary
            self._wandb.log(values)
            self._wandb.summary.update(values)

        self._guard("tensorboard", step, tensorboard)
        self._guard("wandb", step, wandb)
        self._guard("mlflow", step, lambda: self._mlflow.log_metrics(values, step=step))

    def finish(self, summary: dict[str, Any] | None, failed: bool = False) -> None:
        """Record the final summary (when there is one) and close every tracker."""
        if not self.names:
            return
        numbers = _numbers(summary or {})
        step = int((summary or {}).get("steps") or 0)

        def tensorboard() -> None:
            if summary:
                self._tb.add_text("summary", "\n".join(f"    {k}: {v}" for k, v in summary.items()), 0)
            self._tb.close()

        def wandb() -> None:
            self._wandb.summary.update({f"final/{k}": v for k, v in numbers.items()})
            self._wandb.finish(exit_code=1 if failed else 0)

        def mlflow() -> None:
            if summary:
                self._mlflow.log_dict(summary, "summary.json")
                self._mlflow.log_metrics({f"final_{k}": v for k, v in numbers.items()})
            self._mlflow.end_run(status="FAILED" if failed else "FINISHED")

        self._guard("tensorboard", step, tensorboard)
        self._guard("wandb", step, wandb)
        self._guard("mlflow", step, mlflow)
        self.names = []
