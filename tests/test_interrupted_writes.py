"""Rule: an interrupted write or a crash leaves nothing that blocks recovery or misleads.

SIGTERM is handled like Ctrl-C by every command that writes (runtime/signals.py): its temporary is
removed and its lock released; what a SIGKILL leaves is cleaned by the next write to the same place.
A torn last line of metrics.jsonl is dropped with a note by --resume and report alike; a stale lock
whose pid now names another process is taken over; --resume on a changed schedule follows one
schedule; a Ctrl-C reaches a Python caller as a KeyboardInterrupt.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardtune.cli import main
from test_merge import _random_adapter

from tiny import make_model

SRC = Path(__file__).resolve().parents[1] / "src"


@pytest.fixture(scope="module")
def base_and_adapter(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("interrupted")
    make_model(root / "base", "llama")
    _random_adapter(root / "base", root / "adapter", {})
    return root / "base", root / "adapter"


def _stopped_mid_write(argv: list[str]) -> subprocess.Popen:
    """``python -m shardtune ARGV`` stopped (SIGSTOP) inside its write: its lock held, its temporary made."""
    env = {**os.environ, "SHARDTUNE_TEST_FAIL_AT": "stop@write",
           "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "shardtune", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        state = Path(f"/proc/{proc.pid}/stat").read_text().rpartition(")")[2].split()[0]
        if state == "T":
            return proc
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.1)
    proc.kill()
    raise AssertionError("the command never reached its write")


def test_sigterm_or_sigkill_mid_merge_leave_nothing_that_blocks_the_next(base_and_adapter, tmp_path, capsys, caplog):
    base, adapter = base_and_adapter
    out = tmp_path / "merged"
    argv = ["merge", "--model", str(base), "--adapter", str(adapter), "--out", str(out)]

    first = _stopped_mid_write(argv)
    assert (tmp_path / f".merged.tmp-{first.pid}").is_dir() and (tmp_path / ".merged.lock").is_file()
    assert main(argv) == 2  # a second writer meanwhile: refused, naming the first
    assert f"is in use by another run (process {first.pid} on" in capsys.readouterr().err
    first.send_signal(signal.SIGTERM)
    first.send_signal(signal.SIGCONT)
    _, err = first.communicate(timeout=120)
    assert first.returncode == 128 + signal.SIGTERM, err
    assert f"error: stopped by SIGTERM while writing {out}: {out} is as it was" in err and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no temporary folder, no lock

    killed = _stopped_mid_write(argv)  # SIGKILL runs no handler: its temporary and lock stay behind...
    killed.kill()
    killed.communicate(timeout=60)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".merged.lock", f".merged.tmp-{killed.pid}"]
    caplog.set_level(logging.INFO, logger="shardtune")
    assert main(argv) == 0  # ...until the next write to the same place: taken over and removed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["merged"]
    assert f"left by process {killed.pid}" in caplog.text and f".merged.tmp-{killed.pid}" in caplog.text


def test_a_torn_last_metrics_line_is_dropped_by_report_with_a_note(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    lines = [json.dumps({"step": s, "loss": 3.0 - s, "tokens_per_second": 100.0}) for s in (1, 2)]
    torn = b'{"step": 3, "loss": 0.9, "tok'
    (run / "metrics.jsonl").write_bytes(("\n".join(lines) + "\n").encode() + torn)
    assert main(["report", str(run)]) == 0
    err = capsys.readouterr().err
    assert f"metrics.jsonl: its last line ({len(torn)} bytes) was cut off by an interrupted write" in err, err
    assert "the 2 whole records before it are kept" in err and (run / "loss.png").is_file()
    (run / "metrics.jsonl").write_bytes(("\n".join(lines) + "\n").encode() + b"\0" * 4096)  # a power loss's zeros
    assert main(["report", str(run)]) == 0
    assert "was cut off by an interrupted write" in capsys.readouterr().err
    assert not [p for p in run.iterdir() if p.name.startswith(".")]  # the plots were written whole


def test_resume_after_a_torn_metrics_line_follows_one_schedule(trained_run, tmp_path, capsys):
    """A torn last line (SIGKILL, OOM kill, power loss) is dropped with a note, not a JSONDecodeError.
    A resume with a larger --steps and another --lr follows this run's schedule from its first step on:
    its peak, over its number of steps, at the resumed step (docs/checkpoints.md)."""
    from shardtune.train.schedule import lr_factor

    out = tmp_path / "run"
    shutil.copytree(trained_run, out)
    torn = b'{"step": 4, "loss": 2.31, "lr": 0.00'
    with (out / "metrics.jsonl").open("ab") as f:
        f.write(torn)
    code = main(["finetune", "--config", str(out / "config.yaml"), "--out", str(out), "--resume", "--steps", "5",
                 "--lr", "5e-4"])
    err = capsys.readouterr().err
    assert code == 0, err
    assert f"metrics.jsonl: its last line ({len(torn)} bytes) was cut off by an interrupted write" in err, err
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5]
    for m in metrics[3:]:  # warmup: 0 (10% of 5 steps, rounded down)
        assert math.isclose(m["lr"], 5e-4 * lr_factor(m["step"] - 1, 5, 0, 0.1), rel_tol=1e-9), metrics
    assert json.loads((out / "summary.json").read_text())["resumed_from_step"] == 3


def test_a_lock_whose_pid_now_names_another_process_is_taken_over(tmp_path, caplog):
    from shardtune.runtime.lock import RunLock
    from shardtune.runtime.processes import start_ticks

    out = tmp_path / "out"
    out.mkdir()
    caplog.set_level(logging.WARNING, logger="shardtune")
    sleeper = subprocess.Popen(["sleep", "120"])
    try:
        host = socket.gethostname()
        # A lock an older shardtune wrote an hour ago; since (a reboot, a container restart) its pid is `sleep`'s.
        (out / ".lock").write_text(json.dumps({"run": "old", "host": host, "pid": sleeper.pid,
                                               "started": time.time() - 3600}))
        with RunLock(out, "new"):
            assert json.loads((out / ".lock").read_text())["run"] == "new"
        assert f"left by process {sleeper.pid}" in caplog.text and "started after the lock was written" in caplog.text
        # A lock recording its process's start: the same pid with another start is another process.
        (out / ".lock").write_text(json.dumps({"run": "old2", "host": host, "pid": sleeper.pid, "started": time.time(),
                                               "pid_start": start_ticks(sleeper.pid) - 1}))
        with RunLock(out, "newer"):
            pass
        assert f"pid {sleeper.pid} now belongs to another process (sleep 120)" in caplog.text
    finally:
        sleeper.kill()
        sleeper.wait()
    with RunLock(out, "live"):  # the holder alive, as it wrote the lock: refused
        with pytest.raises(Exception, match="is in use by another run"):
            RunLock(out, "intruder").acquire()


def test_ctrl_c_reaches_a_python_caller_as_keyboard_interrupt(run_root, tmp_path, monkeypatch, capsys):
    """``shardtune.finetune()`` stopped by Ctrl-C: a KeyboardInterrupt (``except Exception`` must not swallow
    it), naming the checkpoint and the resume command; the command line exits 130."""
    import shardtune
    import shardtune.launch
    from shardtune.runtime.workers import Stopped

    def stopped(*args, **kwargs):
        raise Stopped(signal.SIGINT)

    monkeypatch.setattr(shardtune.launch, "launch_workers", stopped)
    options = {"model": str(run_root / "model"), "data": str(run_root / "train.jsonl"), "out": str(tmp_path / "a"),
               "steps": 1, "batch-size": 4, "seq-len": 64, "dtype": "fp32", "strategy": "single"}
    with pytest.raises(KeyboardInterrupt) as caught:
        shardtune.finetune(options)
    assert not isinstance(caught.value, Exception)
    assert str(caught.value).startswith("stopped by SIGINT; no complete checkpoint was written. To continue, run: "
                                        f"shardtune finetune --config {tmp_path / 'a' / 'config.yaml'} --resume")
    argv = ["finetune", *[f"--{k}={v}" for k, v in {**options, "out": str(tmp_path / "b")}.items()]]
    assert main(argv) == 130
    assert "error: stopped by SIGINT" in capsys.readouterr().err
