"""Workers forked from a warm starter (runtime/warm_start.py): each starts as a fresh ``python -m`` would, in
the launcher's environment and working directory at the time of the run; runs from one process share the
starter while that environment holds; exit codes, signals and deaths pass through the agent's client."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from shardtune.config import ParallelConfig
from shardtune.runtime import warm_start
from shardtune.runtime.workers import launch_workers

TESTS = Path(__file__).parent


def _reports(out: Path) -> dict[int, dict]:
    return {int(p.stem.removeprefix("rank")): json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))}


def _launch(out: Path, nproc: int = 2) -> dict[int, dict]:
    out.mkdir()
    launch_workers(ParallelConfig(nproc=nproc), "reporting_worker", [str(out)])
    return _reports(out)


@pytest.fixture
def tests_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.delenv(warm_start.START_ENV, raising=False)


def test_runs_from_one_process_share_a_starter_until_the_environment_changes(tmp_path, monkeypatch, tests_on_path):
    import psutil

    first = _launch(tmp_path / "first")
    monkeypatch.chdir(tmp_path)
    second = _launch(tmp_path / "second")
    starters = {r["ppid"] for r in (*first.values(), *second.values())}
    assert len(starters) == 1 and os.getpid() not in starters  # forked, both runs, from one starter
    starter = starters.pop()
    assert psutil.Process(starter).ppid() == os.getpid()
    for report in (*first.values(), *second.values()):
        assert report["imported_at_start"] == ["torch"]  # the starter's imports, not the worker's
    # Each worker is where the launcher was when the run started, with that directory first on its path and
    # the run's arguments, as ``python -m`` gives them.
    assert [r["cwd"] for r in second.values()] == [str(tmp_path)] * 2 == [r["path0"] for r in second.values()]
    assert all(r["argv"] == [str(tmp_path / "second")] for r in second.values())
    assert all(r["cwd"] != str(tmp_path) for r in first.values())
    # A variable read only while running (a test's injected fault) does not ask for another starter: each
    # run's workers see that run's value.
    monkeypatch.setenv("SHARDTUNE_TEST_FAIL_AT", "nowhere")
    injected = _launch(tmp_path / "injected")
    assert {r["ppid"] for r in injected.values()} == {starter}
    assert {r["fail_at"] for r in injected.values()} == {"nowhere"}
    assert {r["fail_at"] for r in second.values()} == {None}

    monkeypatch.setenv("SHARDTUNE_TEST_MARK", "changed")  # read at import by some library: a new starter
    third = _launch(tmp_path / "third")
    assert {r["mark"] for r in third.values()} == {"changed"}
    assert starter not in {r["ppid"] for r in third.values()}
    assert not psutil.pid_exists(starter)  # the old one ended before the new one started


def test_fresh_workers_start_without_a_starter(tmp_path, monkeypatch, tests_on_path):
    monkeypatch.setenv(warm_start.START_ENV, "fresh")
    reports = _launch(tmp_path / "out")
    assert sorted(reports) == [0, 1]
    for report in reports.values():
        assert report["ppid"] == os.getpid()  # the agent's own child, exec'd into the worker
        assert report["imported_at_start"] == []


@pytest.fixture
def starter(tests_on_path):
    """A starter that preloads a module printing at import: a few milliseconds to start."""
    started = warm_start._Starter(dict(os.environ), preload=("noisy_import",))
    yield started
    started.stop()


def _client(starter: warm_start._Starter, out: Path, mode: str, cwd: Path) -> subprocess.Popen:
    out.mkdir(exist_ok=True)
    exe, args = warm_start.client_command(starter.address, {"RANK": "0"}, "reporting_worker", [str(out), mode])
    return subprocess.Popen([exe, *args], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _report(out: Path, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while not (out / "rank0.json").exists():
        assert time.monotonic() < deadline, "the worker did not start"
        time.sleep(0.05)
    time.sleep(0.1)
    return json.loads((out / "rank0.json").read_text())


def test_the_client_ends_as_its_worker_did_with_the_imports_output_replayed(starter, tmp_path):
    client = _client(starter, tmp_path / "out", "exit3", tmp_path)
    stdout, stderr = client.communicate(timeout=60)
    assert client.returncode == 3
    assert stdout == "rank 0 reporting\n"
    assert stderr == "noise printed at import\n"  # once, as a fresh worker would have printed it
    report = _report(tmp_path / "out")
    assert report["imported_at_start"] == ["noisy_import"]
    assert report["ppid"] == starter.proc.pid

    client = _client(starter, tmp_path / "out", "sigterm", tmp_path)
    client.communicate(timeout=60)
    assert client.returncode == -signal.SIGTERM  # a worker killed by a signal: its client, by the same


def test_signals_reach_the_worker_and_a_killed_client_takes_its_worker_along(starter, tmp_path):
    import psutil

    client = _client(starter, tmp_path / "term", "wait", tmp_path)
    _report(tmp_path / "term")
    client.send_signal(signal.SIGTERM)  # the elastic agent stopping its workers
    client.communicate(timeout=60)
    assert client.returncode == 0  # the worker's own SIGTERM handler ran and ended it

    client = _client(starter, tmp_path / "kill", "wait", tmp_path)
    worker = psutil.Process(_report(tmp_path / "kill")["pid"])
    client.kill()  # the agent's SIGKILL after its grace period
    client.wait()
    gone, alive = psutil.wait_procs([worker], timeout=10)
    assert not alive


def test_a_starter_whose_launcher_ends_ends_its_workers(starter, tmp_path):
    import psutil

    client = _client(starter, tmp_path / "out", "wait", tmp_path)
    worker = psutil.Process(_report(tmp_path / "out")["pid"])
    os.close(starter.alive_w)  # what the launcher's death does
    gone, alive = psutil.wait_procs([worker], timeout=10)
    assert not alive
    _, stderr = client.communicate(timeout=60)
    assert client.returncode == 1
    assert "the process that starts shardtune's workers ended, and this worker with it" in stderr


def test_a_starter_that_loaded_the_cuda_driver_execs_fresh_workers(tests_on_path, tmp_path):
    started = warm_start._Starter(dict(os.environ), preload=("noisy_import",), fresh=True)
    try:
        client = _client(started, tmp_path / "out", "ok", tmp_path)
        _, stderr = client.communicate(timeout=60)
        assert client.returncode == 0, stderr
        report = _report(tmp_path / "out")
        assert report["imported_at_start"] == [] and report["ppid"] == started.proc.pid
        assert stderr == ""
    finally:
        started.stop()


def test_an_unknown_start_mode_is_named(monkeypatch):
    from shardtune.config import ConfigError

    monkeypatch.setenv(warm_start.START_ENV, "cold")
    with pytest.raises(ConfigError, match="SHARDTUNE_WORKER_START='cold' is not one of warm, fresh"):
        warm_start.warm()


def test_a_finetune_starts_its_starter_during_its_checks_and_forks_its_workers_from_it(run_root, monkeypatch):
    """The starter starts once the launcher's cheap checks have passed (its imports overlap the data's reading
    and the planning); nothing from then to the launch may change what it was started with, or the launch
    would start a second one."""
    import inspect

    import shardtune

    started = []

    class Counting(warm_start._Starter):
        def __init__(self, *args, **kwargs) -> None:
            started.append(any(frame.function == "preflight" for frame in inspect.stack()))
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(warm_start, "_Starter", Counting)
    monkeypatch.delenv(warm_start.START_ENV, raising=False)
    monkeypatch.setenv("SHARDTUNE_TEST_MARK", "prestart")  # not the environment of any starter running now
    summary = shardtune.finetune({"model": str(run_root / "model"), "data": str(run_root / "train.jsonl"),
                                  "out": str(run_root / "prestart"), "dtype": "fp32", "steps": 1, "batch-size": 4,
                                  "seq-len": 64}, nproc=2)
    assert summary["world_size"] == 2
    assert started == [True]
