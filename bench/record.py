"""What a bench result needs to be read later: the machine it ran on and the command that made it.

Every bench script adds ``run_record()`` to the JSON it writes under bench/results/, and
scripts/gen_benchmarks.py prints it above that file's table in docs/benchmarks.md. A number
without its machine cannot be compared with anything: a CPU without native bf16 matmul runs a bf16
job many times slower than one with it, and two cores shared with other jobs are not two idle ones.
"""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

# The CPU features that decide what --dtype auto picks and how fast its matmuls run.
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


def cpu_facts() -> dict:
    """CPU model, logical cores this process may use, and the ISA flags above that the CPU has."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and value.strip():
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    except OSError:  # not Linux: the model from platform, no flags
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpu": model, "cores": cores, "isa": [f for f in ISA_FLAGS if f in flags]}


def gpu_facts() -> list[str]:
    """Names of the visible CUDA devices (none without torch or CUDA)."""
    try:
        import torch
    except ImportError:
        return []
    if not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).resolve().parent,
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def run_record(argv: list[str] | None = None) -> dict:
    """The ``machine`` and ``command`` entries of a bench result (plus when, and at which commit)."""
    argv = sys.argv if argv is None else argv
    try:
        import torch
        torch_version = torch.__version__
    except ImportError:
        torch_version = None
    return {
        "machine": {**cpu_facts(), "gpus": gpu_facts(), "torch": torch_version},
        "command": shlex.join(["python", os.path.relpath(argv[0]) if argv else "?", *argv[1:]]),
        "commit": git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
    }


def plan_flags(command: str, model: Path) -> list[str]:
    """A measured row's ``shardtune finetune`` flags as ``shardtune plan`` takes them again: ``model``
    (rebuilt in this checkout's cache) for --model, and without the data, output and step flags (the
    benches' records are exactly a row long, so rows are --seq-len wide either way)."""
    words = shlex.split(command)
    flags, skip = [], {"--data", "--out", "--steps", "--warmup-steps"}
    rest = iter(words[words.index("finetune") + 1:])
    for word in rest:
        if word in skip:
            next(rest, None)
        elif word == "--model":
            next(rest, None)
            flags += ["--model", str(model)]
        else:
            flags.append(word)
    return flags


def replan_record() -> dict:
    """What a --replan adds beside a result file's own record: the command, commit and date that predicted its
    measured rows again (the machine and the measurement stay the file's)."""
    return {k: v for k, v in run_record().items() if k in ("command", "commit", "date")}
