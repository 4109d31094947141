"""Rule: a run folder is never lost or mixed up. A refused start leaves it as it was; one run at a time holds
it; an unreadable checkpoint is skipped for the newest readable one; changed data is not resumed silently."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import shardtune
from shardtune.cli import main
from shardtune.errors import ShardtuneError
from shardtune.runtime.lock import RunLock

from tiny import make_run_dir


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return make_run_dir(tmp_path_factory.mktemp("runfolder"), tied=False, records=12)


def _options(root: Path, out: Path, **extra) -> dict:
    return {"model": str(root / "model"), "data": str(root / "train.jsonl"), "out": str(out), "dtype": "fp32",
            "steps": 4, "batch-size": 4, "lr": 1e-2, "strategy": "single", "save-every": 2, "keep-last": 3,
            "seq-len": 64, "log-file": str(out) + ".log", **extra}


@pytest.fixture(scope="module")
def finished(root) -> Path:
    """A finished 1-rank run with checkpoints step-2 and step-4."""
    out = root / "finished"
    shardtune.finetune(_options(root, out))
    return out


def _snapshot(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def _flags(options: dict) -> list[str]:
    return [part for k, v in options.items() for part in (f"--{k}", str(v))]


def test_a_refused_resume_leaves_the_run_folder_as_it_was(root, finished, capsys):
    out = root / "refused"
    shutil.copytree(finished, out)
    before = _snapshot(out)
    assert main(["finetune", *_flags(_options(root, out, **{"lora-r": 4})), "--resume"]) == 2
    err = capsys.readouterr().err
    assert "option 'lora-r' was 8, now 4" in err and "Traceback" not in err
    assert _snapshot(out) == before  # config.yaml, summary.json, metrics, checkpoints: all untouched
    # lora -> dora adds a magnitude tensor per layer: refused before dcp.load, not failing inside it
    assert main(["finetune", *_flags(_options(root, out, **{"lora-variant": "dora"})), "--resume"]) == 2
    err = capsys.readouterr().err
    assert "option 'lora-variant' was 'lora', now 'dora'" in err and "which tensors" in err
    assert _snapshot(out) == before
    # The resume command a finished run prints still works afterwards.
    assert main(["finetune", "--config", str(out / "config.yaml"), "--out", str(out), "--resume", "--steps", "5",
                 "--save-every", "0"]) == 0
    assert json.loads((out / "summary.json").read_text())["resumed_from_step"] == 4


def test_resume_refuses_changed_data_unless_allowed(root, finished, capsys):
    out = root / "data-changed"
    shutil.copytree(finished, out)
    data = root / "edited.jsonl"
    shutil.copy(root / "train.jsonl", data)
    options = _options(root, out, data=str(data), steps=5, **{"save-every": 0})
    meta = json.loads((out / "checkpoints" / "step-4" / "checkpoint.json").read_text())
    meta["options"]["data"] = str(data)
    (out / "checkpoints" / "step-4" / "checkpoint.json").write_text(json.dumps(meta))
    with data.open("a") as f:  # edited in place after the checkpoint
        f.write(json.dumps({"text": "one more record"}) + "\n")
    before = _snapshot(out)
    assert main(["finetune", *_flags(options), "--resume"]) == 2
    err = capsys.readouterr().err
    assert f"the training data {data} changed since checkpoint {out / 'checkpoints' / 'step-4'}" in err
    assert "--allow-data-change" in err and _snapshot(out) == before
    assert main(["finetune", *_flags(options), "--resume", "--allow-data-change"]) == 0
    assert json.loads((out / "summary.json").read_text())["resumed_from_step"] == 4


def test_a_truncated_checkpoint_falls_back_to_the_newest_readable_one(root, finished, caplog):
    out = root / "truncated"
    shutil.copytree(finished, out)
    data_file = max((out / "checkpoints" / "step-4").glob("*.distcp"), key=lambda p: p.stat().st_size)
    size = data_file.stat().st_size
    with data_file.open("r+b") as f:
        f.truncate(size // 2)
    caplog.set_level(logging.WARNING, logger="shardtune")
    summary = shardtune.finetune(_options(root, out, steps=5, **{"save-every": 0}), resume=True)
    assert summary["resumed_from_step"] == 2
    log = Path(str(out) + ".log").read_text()
    assert f"its data file {data_file} is truncated ({size // 2} of" in log + caplog.text


def test_a_second_run_on_the_same_out_is_refused_and_a_stale_lock_taken_over(tmp_path, caplog):
    out = tmp_path / "out"
    with RunLock(out, "run-a") as first:
        assert json.loads(first.path.read_text())["pid"] == os.getpid()
        with pytest.raises(ShardtuneError, match=rf"output directory {out} is in use by another run \(process "
                                                 rf"{os.getpid()} on .*delete {out / '.lock'}"):
            RunLock(out, "run-b").acquire()
        with RunLock(out, "run-a"):  # another node of the same multi-node run joins it
            pass
        assert first.path.is_file()  # ... and leaving does not release the first one's lock
    assert not (out / ".lock").exists()

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = {"run": "old", "host": RunLock(out, "x").owner["host"], "pid": int(dead.stdout), "started": 0}
    (out / ".lock").write_text(json.dumps(stale))
    caplog.set_level(logging.WARNING, logger="shardtune")
    with RunLock(out, "run-c"):
        assert json.loads((out / ".lock").read_text())["run"] == "run-c"
    assert f"left by process {stale['pid']}" in caplog.text and "no longer running" in caplog.text


def test_finetune_on_a_locked_out_is_refused_before_writing(root, tmp_path, capsys):
    out = tmp_path / "busy"
    out.mkdir()
    with RunLock(out, "someone-else"):
        before = _snapshot(out)
        assert main(["finetune", *_flags(_options(root, out))]) == 2
        assert "is in use by another run" in capsys.readouterr().err
        assert _snapshot(out) == before and not (out / "config.yaml").exists()
