"""Rule: nothing a finished run wrote is replaced unless the user asks, and checkpoint faults are clear errors.

``--resume`` with no checkpoint over a previous run is refused (it could only start again at step 0 and
truncate that run's metrics.jsonl); a finished ``--out`` is refused without ``--resume`` or ``--overwrite``;
a saved ``datasets`` directory trains, checkpoints and resumes; DCP's BaseException is caught.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from shardtune.cli import main

from tiny import instruction_records, make_run_dir


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return make_run_dir(tmp_path_factory.mktemp("lostwork"), tied=False, records=8)


def _flags(root: Path, out: Path, *extra: str) -> list[str]:
    return ["finetune", "--model", str(root / "model"), "--data", str(root / "train.jsonl"), "--out", str(out),
            "--dtype", "fp32", "--steps", "2", "--batch-size", "4", "--strategy", "single", "--seq-len", "64", *extra]


def _snapshot(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def finished(root) -> Path:
    """A finished run that kept no checkpoint (the demo run of the issue)."""
    out = root / "finished"
    assert main(_flags(root, out)) == 0
    return out


def test_resume_with_nothing_to_resume_is_refused_and_keeps_the_metrics(root, finished, capsys):
    before = _snapshot(finished)
    assert main(_flags(root, finished, "--resume")) == 2
    err = capsys.readouterr().err
    assert f"option 'resume': {finished} holds no complete checkpoint to resume from" in err, err
    assert "metrics.jsonl" in err and "--overwrite" in err
    assert _snapshot(finished) == before


def test_a_finished_out_is_refused_without_resume_or_overwrite(root, finished, capsys):
    before = _snapshot(finished)
    assert main(_flags(root, finished)) == 2
    err = capsys.readouterr().err
    assert f"option 'out': {finished} holds a finished run" in err and "--overwrite" in err, err
    # it kept no checkpoint: --resume, which would be refused, is not offered
    assert "It kept no checkpoint to continue from" in err and "--resume" not in err, err
    assert _snapshot(finished) == before
    assert main(_flags(root, finished, "--resume", "--overwrite")) == 2
    assert "contradict" in capsys.readouterr().err


def test_overwrite_replaces_a_finished_run_and_its_checkpoints(root, finished, tmp_path):
    out = tmp_path / "again"
    shutil.copytree(finished, out)
    (out / "checkpoints" / "step-9").mkdir(parents=True)  # an old run's checkpoint: never resumed into the new one
    old = json.loads((out / "summary.json").read_text())
    assert main(_flags(root, out, "--overwrite", "--seed", "3")) == 0
    assert not (out / "checkpoints").exists()
    assert json.loads((out / "summary.json").read_text())["wall_seconds"] != old["wall_seconds"]


def test_a_saved_datasets_directory_trains_checkpoints_and_resumes(root, tmp_path):
    import datasets

    saved = tmp_path / "saved"
    datasets.Dataset.from_list(instruction_records(8)).save_to_disk(str(saved))
    out = tmp_path / "run"
    flags = ["finetune", "--model", str(root / "model"), "--data", str(saved), "--out", str(out), "--dtype", "fp32",
             "--batch-size", "4", "--strategy", "single", "--seq-len", "64", "--save-every", "1"]
    assert main([*flags, "--steps", "2"]) == 0
    meta = json.loads((out / "checkpoints" / "step-2" / "checkpoint.json").read_text())
    assert meta["data"]["path"] == str(saved) and meta["data"]["bytes"] > 0
    assert main([*flags, "--steps", "3", "--resume"]) == 0
    assert json.loads((out / "summary.json").read_text())["resumed_from_step"] == 2


def test_damaged_checkpoint_data_is_a_clear_error_not_a_dcp_traceback(root, tmp_path, capsys):
    out = tmp_path / "ckpt"
    assert main(_flags(root, out, "--save-every", "2")) == 0
    step = out / "checkpoints" / "step-2"
    for data in step.glob("*.distcp"):  # same size, other bytes: passes the size checks, fails in DCP
        data.write_bytes(b"\0" * data.stat().st_size)
    code = main(["adapter-from-checkpoint", str(step), str(tmp_path / "adapter")])
    err = capsys.readouterr().err
    assert code == 2 and f"reading checkpoint {step} failed" in err and "Traceback" not in err, err


def test_a_full_disk_at_the_adapter_save_keeps_the_previous_adapter(finished, tmp_path, monkeypatch):
    """The adapter is written under a temporary name and renamed: ENOSPC halfway leaves the old one whole."""
    import errno

    import safetensors.torch

    from shardtune.runtime.files import OutputError
    from shardtune.train.adapter import write_adapter

    adapter = tmp_path / "adapter"
    shutil.copytree(finished / "adapter", adapter)
    before = _snapshot(adapter)

    def full_disk(tensors, path, metadata=None):
        Path(path).write_bytes(b"\0" * 100)  # a part written, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device", path)

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    import torch

    with pytest.raises(OutputError, match="no space left on the device"):
        write_adapter({"x": torch.zeros(2)}, {"peft_type": "LORA"}, adapter, None)
    assert _snapshot(adapter) == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".adapter.tmp")]
