"""--report-to: TensorBoard, W&B (offline) and MLflow (local SQLite store) get the loss curve, config and summary."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardtune.config import ConfigError
from shardtune.train.trackers import Trackers, check_installed, mlflow_store, parse_report_to

from tiny import instruction_records, make_model, write_jsonl


def test_parse_and_unknown_tracker() -> None:
    assert parse_report_to("") == [] and parse_report_to("none") == []
    assert parse_report_to("TensorBoard, mlflow,mlflow") == ["tensorboard", "mlflow"]
    with pytest.raises(ConfigError, match="unknown tracker comet"):
        parse_report_to("tensorboard,comet")


def test_missing_tracker_is_an_error_before_training(monkeypatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match="wandb is not installed: pip install wandb"):
        check_installed("tensorboard,wandb")


def _tb_losses(out: Path) -> dict[int, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    return {e.step: e.value for e in acc.Scalars("train/loss")}


def test_finetune_reports_to_all_three_and_resume_continues_the_runs(tmp_path: Path, monkeypatch) -> None:
    import shardtune

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    started_in = tmp_path / "cwd"
    started_in.mkdir()
    monkeypatch.chdir(started_in)
    model = make_model(tmp_path / "model", "llama")
    data = write_jsonl(tmp_path / "train.jsonl", instruction_records(8))
    out = tmp_path / "out"
    options = {"model": str(model), "data": str(data), "out": str(out), "dtype": "fp32", "batch-size": 2,
               "seq-len": 128, "save-every": 2, "report-to": "tensorboard,wandb,mlflow"}
    shardtune.finetune(options, steps=2)
    summary = shardtune.finetune(options, steps=4, resume=True)
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    expected = {m["step"]: m["loss"] for m in metrics}
    assert sorted(expected) == [1, 2, 3, 4] and summary["resumed_from_step"] == 2

    tb = _tb_losses(out)
    assert sorted(tb) == [1, 2, 3, 4]
    assert all(abs(tb[s] - expected[s]) < 1e-5 for s in tb)

    ids = json.loads((out / "trackers.json").read_text())
    runs = list((out / "wandb").glob("offline-run-*"))
    assert runs and all(r.name.endswith(ids["wandb"]) for r in runs)  # one run id, resumed

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=mlflow_store(out))
    history = client.get_metric_history(ids["mlflow"], "loss")
    assert sorted(m.step for m in history) == [1, 2, 3, 4]
    run = client.get_run(ids["mlflow"])
    assert run.data.params["lora-r"] == "8" and run.info.status == "FINISHED"
    assert "final_train_loss_last" in run.data.metrics
    # everything the trackers write stays in OUT: nothing lands where the user started shardtune
    assert list(started_in.iterdir()) == []
    assert list((out / "mlflow-artifacts").rglob("summary.json"))


def test_other_ranks_log_nothing(tmp_path: Path) -> None:
    trackers = Trackers("tensorboard", {}, tmp_path, enabled=False)
    trackers.log({"step": 1, "loss": 1.0})
    trackers.finish({"x": 1})
    assert not (tmp_path / "tensorboard").exists()
