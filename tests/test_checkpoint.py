"""Resumable checkpoints: exact resume, resharded resume, signals, a lost rank, adapters from checkpoints.

Every run goes through the public API or the CLI: the signals, the lost rank and the documented resume
command through the launcher and its fresh workers; the runs compared for exact and resharded resume on
ranks started as plain torchrun starts them (dist_utils.finetune_on_ranks).
"""

from __future__ import annotations

import json
import logging
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from shardtune.runtime.distributed import COLLECTIVE_TIMEOUT

import cli_process
from dist_utils import finetune_on_ranks, rank_processes

STEPS = 6
EXACT = ("step", "loss", "lr", "grad_norm", "tokens")


@pytest.fixture(scope="module")
def root(run_root) -> Path:
    return run_root


def _options(root: Path, out: str, nproc: int, **extra) -> dict:
    split = {"strategy": "fsdp2", "micro-batch-size": 1} if nproc == 2 else {"strategy": "single"}
    return {"model": str(root / "model"), "data": str(root / "train.jsonl"), "out": str(root / out),
            "dtype": "fp32", "steps": STEPS, "batch-size": 8, "lr": 1e-2, "warmup-steps": 1, "seed": 1,
            "save-every": 2, "keep-last": 3, "log-file": str(root / f"{out}.log"), "nproc": nproc, **split, **extra}


@pytest.fixture(scope="module")
def reference(root) -> Path:
    """An uninterrupted 2-rank FSDP2 run saving steps 2, 4 and 6; started with --resume and nothing to resume."""
    summary = finetune_on_ranks(_options(root, "ref", 2, resume=True), 2)
    assert summary["steps"] == STEPS and summary["resumed_from_step"] == 0
    assert f"nothing to resume in {root / 'ref'}: starting at step 0" in (root / "ref.log").read_text()
    return root / "ref"


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _adapter(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(out / "adapter_model.safetensors")


def _start_from(reference: Path, step: int, out: Path) -> None:
    """``out`` as a run killed right after checkpoint ``step``: that checkpoint, the metrics until then."""
    (out / "checkpoints").mkdir(parents=True)
    shutil.copytree(reference / "checkpoints" / f"step-{step}", out / "checkpoints" / f"step-{step}")
    lines = (reference / "metrics.jsonl").read_text().splitlines(keepends=True)
    (out / "metrics.jsonl").write_text("".join(lines[:step]) + '{"step": 99, "loss": 0.0}\n')  # + a lost step


def _complete(out: Path) -> list[str]:
    return sorted(p.name for p in (out / "checkpoints").iterdir() if (p / "COMPLETE").is_file())


def test_resume_on_the_same_ranks_is_bit_exact_and_skips_broken_checkpoints(root, reference):
    out = root / "same"
    _start_from(reference, 4, out)
    # Newer but unusable: a write that never finished, and a directory without its marker.
    shutil.copytree(reference / "checkpoints" / "step-6", out / "checkpoints" / ".step-6.tmp")
    shutil.copytree(reference / "checkpoints" / "step-6", out / "checkpoints" / "step-5")
    (out / "checkpoints" / "step-5" / "COMPLETE").unlink()
    summary = finetune_on_ranks(_options(root, "same", 2, resume=True, **{"keep-last": 1}), 2)
    assert summary["resumed_from_step"] == 4
    log = (root / "same.log").read_text()
    assert ".step-6.tmp: a checkpoint whose writing never finished" in log
    assert "step-5: no COMPLETE marker" in log
    # Same world size on CPU fp32: the resumed run is the uninterrupted one, bit for bit.
    ref_metrics, metrics = _metrics(reference), _metrics(out)
    assert [{k: m[k] for k in EXACT} for m in metrics] == [{k: m[k] for k in EXACT} for m in ref_metrics]
    ref_adapter, adapter = _adapter(reference / "adapter"), _adapter(out / "adapter")
    assert set(adapter) == set(ref_adapter)
    for key in adapter:
        assert torch.equal(adapter[key], ref_adapter[key]), key
    assert summary["train_loss_first"] == ref_metrics[0]["loss"]
    assert _complete(out) == ["step-6"]  # --keep-last 1, and the leftover .tmp is gone
    assert not list((out / "checkpoints").glob(".step-*"))


def test_resume_on_other_world_sizes_matches(root, reference):
    """2 ranks → 1 (from step 2), then that run's 1-rank checkpoint → 2 ranks (from step 4)."""
    _start_from(reference, 2, root / "two-to-one")
    finetune_on_ranks(_options(root, "two-to-one", 1, resume=True), 1)
    _start_from(root / "two-to-one", 4, root / "one-to-two")
    finetune_on_ranks(_options(root, "one-to-two", 2, resume=True), 2)
    ref_metrics, ref_adapter = _metrics(reference), _adapter(reference / "adapter")
    for name in ("two-to-one", "one-to-two"):
        metrics, adapter = _metrics(root / name), _adapter(root / name / "adapter")
        assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
        for key in ("loss", "grad_norm"):
            torch.testing.assert_close(torch.tensor([m[key] for m in metrics]),
                                       torch.tensor([m[key] for m in ref_metrics]), rtol=1e-5, atol=1e-6)
        for key in ref_adapter:
            torch.testing.assert_close(adapter[key], ref_adapter[key], rtol=1e-4, atol=1e-5, msg=key)
    assert "resumed on 2" in (root / "one-to-two.log").read_text()


def test_the_documented_resume_command_continues_on_other_ranks(root, reference):
    """`shardtune finetune --config OUT/config.yaml --resume` (docs/checkpoints.md) on another number of
    ranks: config.yaml keeps what was asked (auto), so the choice is made again for the new ranks (it used
    to store the 1-rank choice, single, which 2 ranks refuse) and the run continues as the reference."""
    import yaml

    import shardtune
    from shardtune.cli import main

    out = root / "asked"
    first = shardtune.finetune(_options(root, "asked", 1, strategy="auto"))
    assert first["strategy"] == "single" and first["run_plan"]["why"]  # what auto chose: in the run plan
    written = yaml.safe_load((out / "config.yaml").read_text())
    assert written["strategy"] == "auto" and written["micro-batch-size"] is None and written["nproc"] == 1
    # as if it had stopped right after step 2: its checkpoint, its metrics until then, no result yet
    for step in (4, 6):
        shutil.rmtree(out / "checkpoints" / f"step-{step}")
    shutil.rmtree(out / "adapter")
    (out / "summary.json").unlink()
    (out / "metrics.jsonl").write_text("".join((out / "metrics.jsonl").read_text().splitlines(keepends=True)[:2]))
    assert main(["finetune", "--config", str(out / "config.yaml"), "--resume", "--nproc", "2"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["resumed_from_step"] == 2 and summary["world_size"] == 2 and summary["strategy"] != "single"
    ref_metrics, metrics = _metrics(reference), _metrics(out)
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    for key in ("loss", "grad_norm"):
        torch.testing.assert_close(torch.tensor([m[key] for m in metrics]),
                                   torch.tensor([m[key] for m in ref_metrics]), rtol=1e-5, atol=1e-6)
    ref_adapter, adapter = _adapter(reference / "adapter"), _adapter(out / "adapter")
    for key in ref_adapter:
        torch.testing.assert_close(adapter[key], ref_adapter[key], rtol=1e-4, atol=1e-5, msg=key)


def test_checkpoint_holds_lora_state_only_and_gives_the_final_adapter(root, reference, capsys):
    import torch.distributed.checkpoint as dcp

    from shardtune.cli import main
    from shardtune.train.adapter import adapter_bytes

    ckpt = reference / "checkpoints" / "step-6"
    meta = json.loads((ckpt / "checkpoint.json").read_text())
    keys = dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    assert meta["step"] == 6 and meta["world_size"] == 2
    # the options recorded are the run's: its LoRA rank is the rank of the stored lora_A tensors
    assert {keys[f"model.{n}"].size[0] for n in meta["adapter_keys"].values() if "lora_A" in n} \
        == {meta["options"]["lora-r"]}
    weights = {k.removeprefix("model.") for k in keys if k.startswith("model.")}
    assert weights == set(meta["adapter_keys"].values()) and all("lora_" in k for k in weights)
    assert all(k.startswith(("model.", "optim.")) for k in keys)  # no frozen base weight, no buffer
    assert sorted(p.name for p in (ckpt / "rng").iterdir()) == ["rank-0.pt", "rank-1.pt"]
    print(f"\ncheckpoint {adapter_bytes(ckpt)} bytes, adapter {adapter_bytes(reference / 'adapter')} bytes")

    assert main(["adapter-from-checkpoint", str(ckpt), str(root / "from-ckpt")]) == 0
    got, final = _adapter(root / "from-ckpt"), _adapter(reference / "adapter")
    assert set(got) == set(final) and all(torch.equal(got[k], final[k]) for k in final)
    assert (root / "from-ckpt" / "adapter_config.json").read_text() == \
        (reference / "adapter" / "adapter_config.json").read_text()
    assert main(["adapter-from-checkpoint", str(reference / "checkpoints"), str(root / "nope")]) == 2
    assert "is the checkpoints folder of a run, not a checkpoint: give one of its checkpoints (step-2, step-4, " \
           "step-6)" in capsys.readouterr().err


def test_incomplete_or_corrupt_checkpoints_are_skipped_with_a_warning(root, reference, caplog):
    from shardtune.train.checkpoint_files import find_latest

    out = root / "broken"
    _start_from(reference, 2, out)
    ckpts = out / "checkpoints"
    for name in ("step-4", "step-6", ".step-8.tmp"):
        shutil.copytree(reference / "checkpoints" / "step-6", ckpts / name)
    (ckpts / "step-6" / ".metadata").write_bytes(b"not a pickle")
    (ckpts / "step-4" / "checkpoint.json").write_text("{")
    caplog.set_level(logging.WARNING, logger="shardtune")
    assert find_latest(out) == ckpts / "step-2"
    text = caplog.text
    assert f"{ckpts / '.step-8.tmp'}: a checkpoint whose writing never finished" in text
    assert f"{ckpts / 'step-6'}: unreadable" in text and f"{ckpts / 'step-4'}: unreadable" in text
    assert find_latest(root / "no-such-run") is None


def _cli(root: Path, out: str, *extra: str, forked: bool = False) -> subprocess.Popen:
    """``shardtune finetune`` started as a fresh process: its workers are its descendants, as the tests that
    look for them need; ``forked``: forked from a starter that imported already (tests/cli_process.py), the
    launcher alone is this process's (it forwards signals)."""
    options = _options(root, out, 2, steps=100_000, **{"save-every": 1000})
    args = ["finetune", *[part for k, v in options.items() for part in (f"--{k}", str(v))], *extra]
    command = cli_process.command(args) if forked else [sys.executable, "-m", "shardtune", *args]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_for_steps(out: Path, n: int, proc: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    metrics = out / "metrics.jsonl"
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= n):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the run ended or stalled before step {n}:\n{proc.communicate()[0][-3000:]}")
        time.sleep(0.1)


def test_sigterm_saves_a_checkpoint_and_says_how_to_resume(root):
    from shardtune.train.checkpoint_files import find_latest

    out = root / "sigterm"
    proc = _cli(root, "sigterm", forked=True)
    _wait_for_steps(out, 1, proc)
    proc.send_signal(signal.SIGTERM)  # to the launcher, as a scheduler or `kill` would
    output = proc.communicate(timeout=150)[0]
    assert proc.returncode == 128 + signal.SIGTERM, output[-3000:]
    latest = find_latest(out)
    assert latest is not None, output[-3000:]
    step = int(latest.name.removeprefix("step-"))
    hint = next(line for line in output.splitlines() if line.startswith("error: stopped by SIGTERM"))
    assert f"newest complete checkpoint is {latest}" in hint
    command = shlex.split(hint.split("To continue, run: ", 1)[1])
    assert command[:2] == ["shardtune", "finetune"] and "--resume" in command

    # The printed command continues the run (here only two more steps: flags override the config file).
    done = subprocess.run(cli_process.command([*command[1:], "--steps", str(step + 2)]), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [m["step"] for m in _metrics(out)] == list(range(1, step + 3))
    assert json.loads((out / "summary.json").read_text())["resumed_from_step"] == step


def test_sigint_to_the_launcher_stops_workers_cleanly(root):
    """Interrupting a notebook kernel sends SIGINT to the launching process only: workers must not linger."""
    import psutil

    from shardtune.train.checkpoint_files import find_latest

    out = root / "sigint"
    proc = _cli(root, "sigint")
    _wait_for_steps(out, 1, proc)
    workers = list(rank_processes(proc.pid, "shardtune.train").values())
    assert len(workers) == 2
    proc.send_signal(signal.SIGINT)
    output = proc.communicate(timeout=150)[0]
    assert proc.returncode == 128 + signal.SIGINT, output[-3000:]
    assert find_latest(out) is not None, output[-3000:]
    assert "To continue, run:" in output
    gone, alive = psutil.wait_procs(workers, timeout=10)
    assert not alive


def test_a_rank_killed_with_sigkill_ends_the_run_naming_it(root):
    import psutil

    from shardtune.train.checkpoint_adapter import adapter_from_checkpoint
    from shardtune.train.checkpoint_files import find_latest, resume_command

    out = root / "sigkill"
    proc = _cli(root, "sigkill", "--save-every", "2")
    _wait_for_steps(out, 3, proc)  # checkpoint step-2 is complete
    workers = rank_processes(proc.pid, "shardtune.train")
    assert sorted(workers) == [0, 1]
    workers[1].kill()
    killed = time.monotonic()
    output = proc.communicate(timeout=COLLECTIVE_TIMEOUT.total_seconds())[0]
    # The time is the guarantee here: the launcher ends rank 0 at once, where it would otherwise wait
    # in a collective until COLLECTIVE_TIMEOUT. Generous, for a busy 2-core machine.
    assert time.monotonic() - killed < COLLECTIVE_TIMEOUT.total_seconds() / 2
    assert proc.returncode == 2
    assert "error: rank 1 failed (killed by SIGKILL)" in output, output[-3000:]
    assert not workers[0].is_running() or workers[0].status() == psutil.STATUS_ZOMBIE
    latest = find_latest(out)
    assert latest is not None and int(latest.name.removeprefix("step-")) >= 2
    # The last line, and the only error line, names the rank, its signal, the newest checkpoint and the
    # command that resumes (as a SIGTERM's does); rank 0, which only lost its peer, is not another cause.
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and output.strip().splitlines()[-1] == errors[0], output[-3000:]
    assert errors[0].startswith("error: rank 1 failed (killed by SIGKILL)")
    assert errors[0].endswith(f"newest checkpoint: {latest}. To continue, run: {resume_command(out)}")
    assert "This is typically caused by" not in output, output[-3000:]  # gloo's advice, not ours
    assert adapter_from_checkpoint(latest, root / "sigkill-adapter").is_dir()


def test_a_checkpoint_write_that_lost_a_peer_says_so_without_gloos_advice():
    """A rank killed while the others write a checkpoint: their error names the lost peer in gloo's own words,
    not its source location and advice (the launcher names the rank that failed)."""
    from shardtune.train.checkpoint_files import failure_reason

    gloo = RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
                        "[127.0.0.1]:20384: Connection reset by peer. This is typically caused by a remote worker "
                        "hanging or bugs in the application. GLHF!")
    said = failure_reason(gloo)
    assert said == "lost another rank (Read error [127.0.0.1]:20384: Connection reset by peer)"
    assert failure_reason(OSError("disk full")) == "OSError: disk full"  # any other failure: as it was
