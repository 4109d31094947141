"""Rule: no process is left behind. Every worker (training or eval: both start through worker_main) exits within
seconds when its launcher is SIGKILLed, under our launcher and under torchrun."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dist_utils import rank_processes

TESTS = Path(__file__).parent
BOUND = 30  # seconds: generous, the kernel's parent-death signal acts at once

OUR_LAUNCHER = ("from shardtune.config import ParallelConfig; from shardtune.runtime.workers import launch_workers; "
                "launch_workers(ParallelConfig(nproc=2), 'sleeping_worker', [])")


def _workers(launcher: int, timeout: float = 120) -> list:
    """The launcher's two rank processes, once both have started."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = rank_processes(launcher, str(TESTS / "sleeping_worker.py")) or rank_processes(launcher,
                                                                                              "sleeping_worker")
        if len(found) == 2:
            return list(found.values())
        time.sleep(0.2)
    pytest.fail("the two workers did not start")


@pytest.mark.parametrize("launcher", ["shardtune", "torchrun"])
def test_workers_exit_when_the_launcher_is_killed(launcher, tmp_path):
    import psutil

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    env.pop("SHARDTUNE_LAUNCHER_PID", None)
    if launcher == "shardtune":
        command = [sys.executable, "-c", OUR_LAUNCHER]
    else:
        # --standalone: a rendezvous on a free port (``--master-port 0`` alone never lets the workers meet)
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                   str(TESTS / "sleeping_worker.py")]
    log = (tmp_path / "out.log").open("w")
    proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    workers: list = []
    try:
        workers = _workers(proc.pid)
        deadline = time.monotonic() + 120
        while (tmp_path / "out.log").read_text().count("worker ready") < 2:
            if time.monotonic() > deadline:  # a kill before init_worker would not test its parent-death signal
                pytest.fail("the workers did not get past init_worker: " + (tmp_path / "out.log").read_text()[-2000:])
            time.sleep(0.2)  # both past init_worker: the parent-death signal is set
        # Each worker has a process group of its own: a signal to the launcher's group does not reach them.
        assert all(os.getpgid(w.pid) != os.getpgid(proc.pid) for w in workers) or launcher == "torchrun"
        # every process the launcher started: the workers, and under ours the warm starter they were forked
        # from and the agent's client processes
        started = psutil.Process(proc.pid).children(recursive=True)
        assert {w.pid for w in workers} <= {p.pid for p in started}
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        killed = time.monotonic()
        gone, alive = psutil.wait_procs(started, timeout=BOUND)
        assert not alive, (f"{[p.pid for p in alive]} still alive {time.monotonic() - killed:.0f} s after the "
                           "launcher died")
    finally:
        for worker in workers:  # the test failed: leave nothing behind ourselves
            if worker.is_running():
                worker.kill()
        if proc.poll() is None:
            proc.kill()
