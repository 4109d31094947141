"""The numbers do not depend on the strategy: LoRA computes in --dtype everywhere (fp32 master weights)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from test_equivalence import grads_and_training

from dist_utils import run_ranks
from tiny import make_run_dir, run_options


@pytest.fixture(scope="module")
def setup_dir(tmp_path_factory) -> Path:
    return make_run_dir(tmp_path_factory.mktemp("numerics"), tied=False, records=16)


def _options(root: Path, out: str, **extra) -> dict:
    return run_options(root, out, **{"dtype": "bf16", "steps": 3, "batch-size": 4, "lr": 1e-2,
                                     "warmup-steps": 1, "seed": 3, **extra})


def lora_dtypes_single(rank: int, world_size: int, options: dict) -> dict:
    """The dtype each LoRA matmul computes in, and the dtype of the weights the optimizer holds."""
    from shardtune.config import build_config
    from shardtune.runtime import distributed
    from shardtune.runtime.memory import MemoryMonitor
    from shardtune.train.job import setup

    job = setup(build_config(options), distributed.init_worker(), MemoryMonitor(torch.device("cpu")))
    seen = set()
    for name, module in job.model.named_modules():
        if "lora_A" in name and isinstance(module, torch.nn.Linear):
            module.register_forward_hook(lambda m, a, out: seen.add((a[0].dtype, out.dtype)))
    job.step(0)
    masters = {p.dtype for p in job.strategy.trainable(job.model).values()}
    grads = {p.grad.dtype for p in job.strategy.trainable(job.model).values()}
    distributed.teardown()
    return {"compute": seen, "masters": masters, "grads": grads}


def test_single_computes_lora_in_bf16_with_fp32_master_weights(setup_dir):
    (r,) = run_ranks(lora_dtypes_single, 1, _options(setup_dir, "dtypes", strategy="single"))
    assert r["compute"] == {(torch.bfloat16, torch.bfloat16)}
    assert r["masters"] == {torch.float32} and r["grads"] == {torch.float32}


def test_bf16_single_ddp_fsdp2_agree(setup_dir):
    runs = {
        "single": run_ranks(grads_and_training, 1, _options(setup_dir, "single", strategy="single"),
                             timeout=600)[0],
        "ddp": run_ranks(grads_and_training, 2, _options(setup_dir, "ddp", strategy="ddp"), timeout=600)[0],
        "fsdp2": run_ranks(grads_and_training, 2, _options(setup_dir, "fsdp2", strategy="fsdp2",
                                                           **{"micro-batch-size": 1}), timeout=600)[0],
    }
    single = runs["single"]
    for name in ("ddp", "fsdp2"):
        for key, g in single["grads"].items():
            # bf16 keeps 8 bits of mantissa: different reduction orders differ by a few roundings
            torch.testing.assert_close(runs[name]["grads"][key], g, rtol=2e-2, atol=2e-4, msg=f"{name} {key}")
        torch.testing.assert_close(torch.tensor(runs[name]["losses"]), torch.tensor(single["losses"]),
                                   rtol=5e-3, atol=5e-3)
