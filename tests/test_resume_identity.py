"""Rule: resumable state records what it was made from. ``--resume`` against another base model is refused
before any weight is loaded, naming what differs; a checkpoint that predates the record still resumes, with a
note; ``--resume`` in an empty ``--out`` starts at step 0 and says so, over a finished run it is refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from shardtune.cli import main

from tiny import instruction_records, make_model, write_jsonl


def _flags(root: Path, out: Path, model: str = "model", steps: int = 1, *extra: str) -> list[str]:
    return ["finetune", "--model", str(root / model), "--data", str(root / "train.jsonl"), "--out", str(out),
            "--dtype", "fp32", "--steps", str(steps), "--batch-size", "4", "--strategy", "single", "--seq-len", "64",
            "--save-every", "1", "--resume", "--log-file", str(root / f"{out.name}-{steps}.log"), *extra]


def _snapshot(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("identity")
    make_model(root / "model", "llama")
    make_model(root / "wider", "llama", hidden=64)
    write_jsonl(root / "train.jsonl", instruction_records(8))
    return root


@pytest.fixture(scope="module")
def run(root) -> Path:
    """One step, checkpointed, started as a scheduler starts every run: --resume, into an empty --out."""
    out = root / "run"
    out.mkdir()
    assert main(_flags(root, out)) == 0
    return out


def test_resume_in_an_empty_out_starts_at_step_0_and_says_so(root, run):
    assert f"nothing to resume in {run}: starting at step 0" in (root / "run-1.log").read_text()
    assert json.loads((run / "summary.json").read_text())["resumed_from_step"] == 0
    meta = json.loads((run / "checkpoints" / "step-1" / "checkpoint.json").read_text())
    assert meta["model"]["config"]["hidden_size"] == 32 and meta["model"]["tensors"] > 0


def test_resume_over_a_finished_run_without_checkpoints_is_refused(root, run, tmp_path, capsys, no_workers):
    finished = tmp_path / "finished"
    shutil.copytree(run, finished, ignore=shutil.ignore_patterns("checkpoints"))
    before = _snapshot(finished)
    assert main(_flags(root, finished)) == 2
    assert f"{finished} holds no complete checkpoint to resume from" in capsys.readouterr().err
    assert _snapshot(finished) == before


def test_resume_against_another_base_model_is_refused_before_loading(root, run, capsys, no_workers):
    before = _snapshot(run)
    assert main(_flags(root, run, "wider", 2)) == 2
    err = capsys.readouterr().err
    assert "it was made from another base model than --model" in err, err
    assert "hidden_size was 32, now 64" in err and f"--model was {root / 'model'}" in err and "Traceback" not in err
    assert _snapshot(run) == before


def test_a_checkpoint_from_before_the_model_record_still_resumes(root, run, tmp_path):
    out = tmp_path / "old"
    shutil.copytree(run, out)
    meta_file = out / "checkpoints" / "step-1" / "checkpoint.json"
    meta = json.loads(meta_file.read_text())
    del meta["model"]
    meta_file.write_text(json.dumps(meta))
    assert main(_flags(root, out, "model", 2)) == 0
    log = (root / "old-2.log").read_text()
    assert log.count("does not record its base model (an older shardtune wrote it)") == 1, log
    assert json.loads((out / "summary.json").read_text())["resumed_from_step"] == 1
