"""Launching: several nodes on loopback, a notebook kernel, and failures that end every rank."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardtune.runtime.distributed import COLLECTIVE_TIMEOUT
from shardtune.runtime.workers import free_port

import cli_process

TESTS = Path(__file__).parent
REPO = TESTS.parent


@pytest.fixture(scope="module")
def tiny(run_root) -> Path:
    return run_root


def _options(root: Path, out: str) -> dict[str, str]:
    return {"model": str(root / "model"), "data": str(root / "train.jsonl"), "out": str(root / out),
            "dtype": "fp32", "steps": "3", "batch-size": "4", "lr": "1e-2", "strategy": "fsdp2"}


def _flags(root: Path, out: str) -> list[str]:
    return [part for key, value in _options(root, out).items() for part in (f"--{key}", value)]


def test_worker_exception_names_the_rank_and_stops_the_others(monkeypatch):
    from shardtune.config import ParallelConfig
    from shardtune.runtime.cpu_tuning import worker_threads
    from shardtune.runtime.worker_failures import WorkerError
    from shardtune.runtime.workers import launch_workers

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    for name in ("OMP_NUM_THREADS", "PYTHONUNBUFFERED", "GLIBC_TUNABLES"):
        monkeypatch.delenv(name, raising=False)
    before = dict(os.environ)
    started = time.monotonic()
    with pytest.raises(WorkerError, match=r"rank 1 failed.*rank one broke on purpose") as failed:
        launch_workers(ParallelConfig(nproc=2), "failing_worker", [])
    # the workers get their share of the cores; the caller (a notebook, say) keeps its environment
    assert f"OMP_NUM_THREADS={worker_threads(2)})" in str(failed.value)
    assert dict(os.environ) == before
    # Rank 0 sat in a barrier: the launcher, not the collective timeout, ended it. The time is the
    # guarantee here; the bound is generous, for a busy 2-core machine.
    assert time.monotonic() - started < COLLECTIVE_TIMEOUT.total_seconds() / 2


def test_a_rank_that_only_lost_its_peer_is_not_named_the_cause(tmp_path):
    """Both ranks fail in the same second without error files: stderr shows which one lost a peer."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from shardtune.runtime.worker_failures import describe

    errors = {0: "RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:11162",
              1: "RuntimeError: rank one broke on purpose"}
    failures = {}
    for rank, text in errors.items():
        log = tmp_path / "run" / "attempt_0" / str(rank)
        log.mkdir(parents=True)
        (log / "stderr.log").write_text(f"Traceback (most recent call last):\n{text}\n")
        failures[rank] = ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=1,
                                        error_file=str(tmp_path / "none.json"))
        failures[rank].timestamp = 1_700_000_000
    message = str(describe(ChildFailedError("worker", failures), tmp_path))
    assert message.startswith("rank 1 failed (exit code 1): RuntimeError: rank one broke on purpose"), message


def test_two_nodes_on_loopback_and_torchrun_give_the_single_node_adapter(tiny, monkeypatch):
    from safetensors.torch import load_file

    import shardtune

    endpoint = f"127.0.0.1:{free_port()}"
    runs = [
        # Both nodes share one --out, as on a shared file system: the run folder's lock belongs to the run.
        cli_process.command(["finetune", *_flags(tiny, "node0"), "--nproc", "1", "--nnodes", "2", "--node-rank", str(i),
                             "--rdzv-endpoint", endpoint])
        for i in (0, 1)
    ]
    # Plain torchrun starting `shardtune finetune` on every rank: the command trains in place.
    runs.append([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                 "-m", "shardtune", "finetune", *_flags(tiny, "torchrun")])
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for cmd in runs]
    logs = [p.communicate(timeout=900)[0] for p in procs]  # only ends a hang: a busy machine is slow
    assert [p.returncode for p in procs] == [0, 0, 0], logs
    assert logs[2].count("train_loss_last") == 1, logs[2]  # rank 0 alone prints the result
    assert not (tiny / "node0" / ".lock").exists() and not (tiny / "torchrun" / ".lock").exists()
    for name in ("OMP_NUM_THREADS", "PYTHONUNBUFFERED", "GLIBC_TUNABLES"):
        monkeypatch.delenv(name, raising=False)
    before = dict(os.environ)
    summary = shardtune.finetune(_options(tiny, "one-node"), nproc=2)
    assert summary["world_size"] == 2
    assert dict(os.environ) == before  # nothing set for the workers stays in the caller's process
    one = load_file(tiny / "one-node" / "adapter" / "adapter_model.safetensors")
    for out in ("node0", "torchrun"):
        other = load_file(tiny / out / "adapter" / "adapter_model.safetensors")
        assert set(one) == set(other)
        for key in one:
            assert (one[key] - other[key]).abs().max() < 1e-5, (out, key)


def test_notebook_runs_a_two_process_finetune_and_streams_progress(tiny):
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(REPO / "examples" / "finetune_notebook.ipynb", as_version=4)
    nb.cells[1].source = (
        f"MODEL = {str(tiny / 'model')!r}\nDATA = {str(tiny / 'train.jsonl')!r}\nVAL_DATA = DATA\n"
        f"OUT = {str(tiny / 'notebook')!r}\nSTEPS = 2\nEXTRA = {{'dtype': 'fp32', 'seq-len': 64}}"
    )
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(REPO)}}).execute()
    run_cell, print_cell = nb.cells[2], nb.cells[3]
    streamed = "".join(o.get("text", "") for o in run_cell.outputs if o.output_type == "stream")
    assert "finetune" in streamed and "2/2" in streamed  # the workers' progress bar reached the cell
    printed = "".join(o.get("text", "") for o in print_cell.outputs if o.output_type == "stream")
    assert "on 2 ranks (fsdp2)" in printed
    assert (tiny / "notebook" / "adapter" / "adapter_model.safetensors").is_file()


def test_the_launcher_runs_on_torch_without_a_shutdown_timeout() -> None:
    """torch 2.11 (the GPU images' torch) has no LaunchConfig.shutdown_timeout: passing it failed every launch."""
    import dataclasses

    from torch.distributed.launcher.api import LaunchConfig

    from shardtune.runtime.workers import STOP_TIMEOUT, _shutdown_timeout

    @dataclasses.dataclass
    class OldLaunchConfig:
        min_nodes: int = 1

    assert _shutdown_timeout(OldLaunchConfig) == {}
    assert _shutdown_timeout(LaunchConfig) == {"shutdown_timeout": STOP_TIMEOUT}
