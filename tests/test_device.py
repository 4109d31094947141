"""Device and backend choice (runtime/device.py), without a GPU: torch's CUDA queries are stubbed."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from shardtune.config import ConfigError, build_config
from shardtune.runtime import device


@pytest.fixture
def gpus(monkeypatch):
    """Pretend this machine has ``n`` GPUs."""
    def set_count(n: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    return set_count


def test_auto_follows_the_machine_and_cpu_can_be_forced_on_a_gpu_machine(gpus, monkeypatch):
    monkeypatch.delenv("SHARDTUNE_DEVICE", raising=False)
    gpus(2)
    assert device.device_type("auto") == "cuda"
    assert device.device_type("cpu") == "cpu"
    monkeypatch.setenv("SHARDTUNE_DEVICE", "cpu")  # what the test suite's conftest sets
    assert device.device_type("auto") == "cpu"
    assert device.device_type("cuda") == "cuda"  # an explicit --device wins over the environment
    gpus(0)
    monkeypatch.delenv("SHARDTUNE_DEVICE")
    assert device.device_type("auto") == "cpu"


def test_cuda_without_a_gpu_is_a_config_error(gpus):
    gpus(0)
    with pytest.raises(ConfigError, match="'device'.*no CUDA GPU"):
        device.device_type("cuda")


def test_bad_environment_value_is_named(monkeypatch):
    monkeypatch.setenv("SHARDTUNE_DEVICE", "tpu")
    with pytest.raises(ConfigError, match="SHARDTUNE_DEVICE"):
        device.device_type("auto")


def test_backend_per_device_and_offload():
    assert device.backend("cpu") == "gloo"
    assert device.backend("cpu", cpu_offload=True) == "gloo"
    assert device.backend("cuda") == "nccl"
    # offloaded FSDP2 shards and gradients are CPU tensors: their collectives need gloo next to NCCL
    assert device.backend("cuda", cpu_offload=True) == "cuda:nccl,cpu:gloo"


def test_one_gpu_per_local_rank(gpus):
    gpus(2)
    assert device.local_device("cuda", 1, 2) == torch.device("cuda", 1)
    with pytest.raises(ConfigError, match="3 ranks on this node but 2 GPU"):
        device.local_device("cuda", 2, 3)  # today's modulo would have put ranks 0 and 2 on GPU 0
    assert device.local_device("cpu", 5, 8) == torch.device("cpu")


def test_local_world_size_from_the_launcher(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # 2 nodes x 4: the node's count, not world // nnodes
    assert device.local_world_size() == 4
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert device.local_world_size() == 8


def test_preflight_refuses_more_ranks_than_gpus_before_launch(gpus, tmp_path):
    from shardtune.preflight import preflight

    gpus(1)
    cfg = build_config({"model": str(tmp_path / "missing"), "data": "d.jsonl", "out": str(tmp_path / "o"),
                        "nproc": 2, "device": "cuda"})
    with pytest.raises(ConfigError, match="nproc.*2 ranks on this node but 1 GPU"):
        preflight(cfg)  # before the model directory is even looked at


def test_one_process_without_launcher_joins_a_group_of_one(monkeypatch):
    # Without MASTER_ADDR: a group of one with the device's backend (NCCL on CUDA; gloo here).
    import torch.distributed as dist

    from shardtune.runtime import distributed

    for var in ("MASTER_ADDR", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    worker = distributed.init_worker("cpu")
    try:
        assert (worker.world_size, worker.local_world_size, worker.device) == (1, 1, torch.device("cpu"))
        assert dist.get_backend() == "gloo"
    finally:
        distributed.teardown()


def test_cuda_peaks_per_phase_for_the_summary():
    from shardtune.runtime.memory import MemoryMonitor

    monitor = MemoryMonitor(torch.device("cpu"))
    monitor.close()
    monitor.peaks = {"load": {"resident_mb": 9.0, "cuda_allocated_mb": 100.04, "cuda_reserved_mb": 128.0},
                     "train": {"resident_mb": 9.0}}
    assert monitor.cuda_peaks_mb() == {"load": {"allocated": 100.0, "reserved": 128.0},
                                       "train": {"allocated": None, "reserved": None}}


def test_runtime_mb_on_gpu_is_the_memory_held_outside_torchs_allocator(monkeypatch):
    """summary.json's runtime_mb is the planner's "runtime" measured: on a GPU not memory_allocated before
    loading (about 0: the CUDA context is outside torch's counters) but what the device holds beyond
    torch's reserved blocks (context, NCCL's buffers), the most seen at a phase's end."""
    from shardtune.runtime.memory import MB, MemoryMonitor

    reserved, outside = [1200 * MB], [700 * MB]
    total = 80 * 1024 * MB
    for name, value in {"memory_allocated": 0, "max_memory_allocated": 1000 * MB, "max_memory_reserved": 1300 * MB,
                        "reset_peak_memory_stats": None}.items():
        monkeypatch.setattr(torch.cuda, name, lambda device=None, value=value: value)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: reserved[0])
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (total - reserved[0] - outside[0], total))
    monitor = MemoryMonitor(torch.device("cuda", 0))
    monitor.close()
    assert monitor.runtime_mb() is None
    with monitor.phase("load"):
        pass
    assert monitor.runtime_mb() == 700
    with monitor.phase("train"):
        reserved[0], outside[0] = 5000 * MB, 1724 * MB  # NCCL's buffers came with the first collectives
    assert monitor.runtime_mb() == 1724
    cpu = MemoryMonitor(torch.device("cpu"))
    cpu.close()
    with cpu.phase("load"):
        pass
    assert cpu.runtime_mb() == round(cpu.starts["load"], 1) > 0  # CPU: the process before loading


def test_auto_dtype_is_bf16_only_where_the_hardware_computes_in_it(gpus, monkeypatch):
    monkeypatch.setattr(device, "cpu_has_fast_bf16", lambda: False)  # AVX2 only: bf16 matmul ~50x slower
    assert device.auto_dtype("cpu") == "fp32"
    monkeypatch.setattr(device, "cpu_has_fast_bf16", lambda: True)  # AVX512 / AMX
    assert device.auto_dtype("cpu") == "bf16"
    gpus(1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(major=7))  # T4, V100
    assert device.auto_dtype("cuda") == "fp16"
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(major=8))  # A100 on
    assert device.auto_dtype("cuda") == "bf16"
    gpus(0)
    assert device.auto_dtype("cuda") == "bf16"  # plan --device cuda on a CPU machine: a recent GPU


def test_auto_dtype_counts_no_emulated_bf16_and_asks_only_this_ranks_gpu(gpus, monkeypatch):
    """torch's is_bf16_supported() says yes on a T4/V100 (it counts emulation, trying an allocation),
    and asks current_device(), GPU 0 in every rank before set_device: auto must pick fp16 there, read
    from the properties of the rank's own GPU, touching no other."""
    gpus(4)
    asked = []

    def properties(index):
        asked.append(index)
        return SimpleNamespace(major=7, minor=5)  # a T4

    def touches_gpu(*args, **kwargs):
        raise AssertionError("the dtype probe touched a GPU (current_device / an allocation)")

    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)
    monkeypatch.setattr(torch.cuda, "current_device", touches_gpu)
    monkeypatch.setattr(torch.cuda, "_check_bf16_tensor_supported", lambda device: True)  # emulation works
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)  # torch's own lazy init is not in question
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert device.auto_dtype("cuda") == "fp16"
    assert asked == [3]


def test_decide_dtype_replaces_auto_once_and_keeps_a_given_dtype(gpus, monkeypatch):
    gpus(0)
    monkeypatch.setattr(device, "cpu_has_fast_bf16", lambda: False)
    cfg = build_config({"model": "m", "data": "d"})
    assert cfg.model.dtype == "auto"
    assert device.decide_dtype(cfg).model.dtype == "fp32"
    assert device.decide_dtype(build_config({"model": "m", "dtype": "bf16"})).model.dtype == "bf16"
    assert device.decide_dtype(build_config({"model": "m", "device": "cuda"})).model.dtype == "bf16"


def test_the_cpu_check_matches_torchs_own():
    assert device.cpu_has_fast_bf16() == bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
