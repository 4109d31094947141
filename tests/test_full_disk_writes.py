"""Rule: a full disk at a write of the training loop ends the run clearly and loses nothing already written.

``metrics.jsonl`` failing: exit 2 naming the file, its whole lines kept, the checkpoints written before kept.
A tracker failing: dropped with one warning, training goes on. The disk is filled at a chosen write by
``SHARDTUNE_TEST_FAIL_AT=full@NAME:STEP`` (runtime/failure.py), in the worker, through the command line.
"""

from __future__ import annotations

import json

from shardtune.cli import main
from shardtune.runtime.failure import FAIL_AT


def test_full_disk_at_metrics_and_tracker_writes(run_root, tmp_path, monkeypatch, capsys):
    from shardtune.train.checkpoint_files import find_latest

    out, log = tmp_path / "out", tmp_path / "run.log"
    # The tracker's writes fail from step 2 on, metrics.jsonl's at step 3.
    monkeypatch.setenv(FAIL_AT, "full@tensorboard:2,full@metrics.jsonl:3")
    code = main(["finetune", "--model", str(run_root / "model"), "--data", str(run_root / "train.jsonl"),
                 "--out", str(out), "--dtype", "fp32", "--steps", "4", "--batch-size", "4", "--seq-len", "64",
                 "--strategy", "single", "--save-every", "1", "--report-to", "tensorboard", "--log-file", str(log)])
    err, text = capsys.readouterr().err, log.read_text()
    assert code == 2, err
    assert f"cannot write {out / 'metrics.jsonl'}: no space left on the device" in err, err
    assert "Traceback" not in err + text
    # the tracker went first, with one warning, and the training went on to step 3
    assert text.count("--report-to tensorboard stopped working at step 2") == 1, text
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert find_latest(out) == out / "checkpoints" / "step-2"  # the state written before the failure
    assert not (out / "adapter").exists() and not (out / "summary.json").exists()


def test_a_full_disk_under_the_log_file_ends_the_run_clearly(run_root, tmp_path, monkeypatch, capsys):
    """--log-file whose writes fail: exit 2 naming the file, not Python's "--- Logging error ---" and exit 0."""
    log = tmp_path / "run.log"
    monkeypatch.setenv(FAIL_AT, "full@run.log:0")
    code = main(["finetune", "--model", str(run_root / "model"), "--data", str(run_root / "train.jsonl"),
                 "--out", str(tmp_path / "out"), "--dtype", "fp32", "--steps", "1", "--batch-size", "4",
                 "--seq-len", "64", "--strategy", "single", "--log-file", str(log)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"cannot write {log}: no space left on the device" in err, err
    assert "Logging error" not in err and "Traceback" not in err
    assert not (tmp_path / "out" / "adapter").exists()
