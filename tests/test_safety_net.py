"""Rule: an exception no check foresaw ends as one paragraph and exit code 3, never a traceback on screen.

A failure is injected at each stage of a run (``SHARDTUNE_TEST_FAIL_AT``); the user sees what failed,
in which stage, the exception's message, and where the full traceback was written. A rank that stops
responding ends the run after ``--collective-timeout``, naming it; a peer node that never joins ends
the rendezvous after the same timeout, and the lock is released.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from shardtune.runtime.workers import free_port

import cli_process
from tiny import make_run_dir


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return make_run_dir(tmp_path_factory.mktemp("safety"), tied=False, records=8)


def _finetune(root: Path, out: Path, *extra: str, env: dict | None = None,
              timeout: float = 300) -> subprocess.CompletedProcess:
    """``shardtune finetune`` as a process of its own (forked from a starter: tests/cli_process.py)."""
    args = ["finetune", "--model", str(root / "model"), "--data", str(root / "train.jsonl"), "--out", str(out),
            "--dtype", "fp32", "--steps", "2", "--batch-size", "4", "--seq-len", "64", *extra]
    environ = {**os.environ, **(env or {})}
    return subprocess.run(cli_process.command(args, environ), capture_output=True, text=True, timeout=timeout,
                          env=environ)


@pytest.mark.parametrize("stage", ["preflight", "launch", "load", "train", "save"])
def test_an_unexpected_exception_at_each_stage_is_one_paragraph_and_exit_3(root, tmp_path, stage):
    out = tmp_path / "out"
    done = _finetune(root, out, "--strategy", "single", env={"SHARDTUNE_TEST_FAIL_AT": stage})
    err = done.stderr
    assert done.returncode == 3, err
    assert "Traceback" not in err, err
    assert f"failed unexpectedly in stage '{stage}': RuntimeError: injected failure at stage '{stage}'" in err, err
    written = Path(err.split("The full traceback is in ")[1].split(":")[0])
    assert "Traceback (most recent call last)" in written.read_text()
    if stage == "preflight":  # nothing appears in --out before the run is accepted
        assert not out.exists() and written.parent != out
    else:
        assert written == out / "error-traceback.txt"
        assert not (out / ".lock").exists()


def test_a_rank_that_stops_responding_is_named_after_the_collective_timeout(root, tmp_path):
    """Rank 1 stops responding when training starts: rank 0 gives up after --collective-timeout."""
    started = time.monotonic()
    done = _finetune(root, tmp_path / "out", "--nproc", "2", "--strategy", "ddp", "--collective-timeout", "10",
                     env={"SHARDTUNE_TEST_FAIL_AT": "hang@train", "SHARDTUNE_STOP_TIMEOUT": "3"})
    assert done.returncode == 2, done.stderr
    assert "rank 1 stopped responding" in done.stderr and "newest checkpoint: none" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    assert time.monotonic() - started < 200


def test_a_peer_node_that_never_joins_ends_the_rendezvous(root, tmp_path):
    out = tmp_path / "out"
    endpoint = f"127.0.0.1:{free_port()}"
    done = _finetune(root, out, "--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", endpoint,
                     "--collective-timeout", "5", "--strategy", "ddp")
    assert done.returncode == 2, done.stderr
    assert f"the other nodes did not join the rendezvous at {endpoint} within --collective-timeout 5 s" \
        in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and not (out / ".lock").exists()
