"""Which device a run uses and which collective backend goes with it: decided here and nowhere else.

``--device auto`` means CUDA when a GPU is visible. ``SHARDTUNE_DEVICE`` (cpu or cuda) replaces
``auto`` for a whole process tree: the CPU test suite sets it to ``cpu`` on GPU machines, and an
explicit ``--device`` still wins over it.

Backends: NCCL for CUDA, gloo for CPU; with ``--cpu-offload`` on CUDA, FSDP2's parameters and
gradients are CPU tensors (clipping's norm, the found-inf of fp16's scaler), so the group needs
both: ``cuda:nccl,cpu:gloo``, each collective going to the backend of its tensors' device.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import torch

from shardtune.config import Config, ConfigError
from shardtune.runtime.compat import cpu_has_fast_bf16

DEVICES = ("auto", "cpu", "cuda")


def device_type(requested: str = "auto") -> str:
    """'cuda' or 'cpu' for ``--device requested``; ConfigError when CUDA is asked for but absent."""
    if requested == "auto":
        requested = os.environ.get("SHARDTUNE_DEVICE", "auto") or "auto"
        if requested not in DEVICES:
            raise ConfigError(f"SHARDTUNE_DEVICE={requested!r} is not one of {', '.join(DEVICES)}")
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise ConfigError("option 'device': 'cuda' was asked for, but torch sees no CUDA GPU "
                          f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'none'})")
    if requested not in DEVICES:
        raise ConfigError(f"option 'device': {requested!r} is not one of {', '.join(DEVICES)}")
    return requested


def check_local_ranks(kind: str, local_ranks: int) -> None:
    """One GPU per local rank: NCCL refuses two ranks on one GPU, and it says so only at the first collective."""
    if kind != "cuda":
        return
    gpus = torch.cuda.device_count()
    if local_ranks > gpus:
        raise ConfigError(
            f"option 'nproc': {local_ranks} ranks on this node but {gpus} GPU(s) visible "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); NCCL needs one GPU per "
            "rank: lower --nproc, or use --device cpu"
        )


def warn_oversubscribed(kind: str, local_ranks: int) -> None:
    """More CPU workers than cores: legal, but every rank then waits for a core at each step, and a run
    that looks busy takes many times longer than one with fewer ranks; say so before it starts."""
    if kind != "cpu":
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if local_ranks > cores:
        logging.getLogger("shardtune").warning(
            "option 'nproc': %d CPU workers on %d usable core(s): they will take turns on the cores and the "
            "run will be much slower than with --nproc %d or fewer", local_ranks, cores, cores)


def local_device(kind: str, local_rank: int = 0, local_ranks: int = 1) -> torch.device:
    """This rank's device: GPU ``local_rank`` on CUDA (after checking there are enough), else the CPU."""
    if kind != "cuda":
        return torch.device("cpu")
    check_local_ranks(kind, local_ranks)
    return torch.device("cuda", local_rank)


def pick_device(requested: str = "auto") -> torch.device:
    """The device of a one-process tool (generate, plan): the first GPU, or the CPU."""
    return local_device(device_type(requested))


def backend(kind: str, cpu_offload: bool = False) -> str:
    """The process group's backend for ``kind``: NCCL for GPUs, plus gloo for offloaded CPU tensors."""
    if kind == "cuda":
        return "cuda:nccl,cpu:gloo" if cpu_offload else "nccl"
    return "gloo"


def auto_dtype(kind: str) -> str:
    """What ``--dtype auto`` means on ``kind`` ('cuda' or 'cpu'): bf16 where the hardware multiplies in
    it at full speed, else fp16 (GPUs before Ampere: T4, V100) or fp32 (CPUs without AVX512/AMX).

    On a CPU without AVX512-BF16/AMX torch's bf16 matmul falls back to a reference loop, many times
    slower than fp32's, so bf16 there would slow a fine-tune down by far more than it saves.
    ``cuda`` on a machine without CUDA (``plan --device cuda``): bf16, as on every recent GPU.
    """
    if kind == "cuda":
        return "bf16" if not torch.cuda.is_available() or cuda_has_native_bf16() else "fp16"
    return "bf16" if cpu_has_fast_bf16() else "fp32"


def cuda_has_native_bf16() -> bool:
    """Whether this rank's GPU computes in bf16 natively (compute capability 8.0 on: Ampere, Hopper…;
    ROCm: every GPU torch supports), read from the device's properties.

    ``torch.cuda.is_bf16_supported()`` by default counts emulation, so a T4 or V100 (sm75/sm70) said
    yes and ran emulated bf16 instead of fp16; and it asks ``current_device()``, which before
    ``set_device`` is GPU 0 in every rank, allocating a tensor there when it tries emulation. This is
    its ``including_emulation=False`` answer for the GPU of ``LOCAL_RANK`` (the launcher's: the
    first), without allocating on any GPU.
    """
    if torch.version.hip:
        return True
    index = int(os.environ.get("LOCAL_RANK", "0"))
    if not 0 <= index < torch.cuda.device_count():
        index = 0
    return torch.cuda.get_device_properties(index).major >= 8


def decide_dtype(cfg: Config) -> Config:
    """``cfg`` with ``--dtype auto`` replaced by the dtype for its device (the one planned for, on
    ``plan --device cuda`` without a GPU here); decided once, before the workers start."""
    if cfg.model.dtype != "auto":
        return cfg
    kind = planned_device_type(cfg.parallel.device)
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dtype=auto_dtype(kind)))


def local_world_size() -> int:
    """Ranks on this node: ``LOCAL_WORLD_SIZE`` (set by torchrun and our launcher, right on every node)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))


def planned_device_type(requested: str = "auto") -> str:
    """The device type a run is planned for, the one decision every planner, choice and run plan reads:
    as ``device_type`` (``SHARDTUNE_DEVICE`` included), except that ``--device cuda`` on a machine
    without a GPU plans for GPUs (``shardtune plan`` answers for another machine; a run refuses earlier)."""
    if requested == "cuda" and not torch.cuda.is_available():
        return "cuda"
    return device_type(requested)


def trace_device(kind: str) -> torch.device:
    """Where the planner's fake-tensor pass runs for a run planned on ``kind``: that device, except a
    GPU planned for from a machine without CUDA, traced on the CPU device (a CUDA fake pass needs CUDA:
    SDPA aborts the process without it); the CUDA terms (context, gathers) then come from the memory model."""
    if kind == "cuda" and torch.cuda.is_available():
        return torch.device("cuda", 0)
    return torch.device("cpu")
