"""Out of memory on the device is no unforeseen crash: it names the stage, the planned peak and what would fit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dist_utils import run_ranks
from tiny import make_run_dir, run_options

TORCH_SAYS = "CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity of 79.1 GiB"


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return make_run_dir(tmp_path_factory.mktemp("oom"), records=8)


def run_out_of_memory(rank: int, world_size: int, options: dict, where: str) -> dict:
    """``recipe.run`` with ``where`` (build_model: loading; train_step: a step; both called by train/job.py)
    raising torch's OOM error."""
    from shardtune.config import build_config
    from shardtune.train import job, recipe

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError(TORCH_SAYS)

    setattr(job, where, out_of_memory)  # the job runs the step and builds the model
    Path(options["out"]).mkdir(parents=True, exist_ok=True)  # the launcher's part
    try:
        recipe.run(build_config(options))
    except BaseException as err:  # noqa: BLE001 - what the worker would end with is the point
        from shardtune.errors import ShardtuneError

        return {"user_error": isinstance(err, ShardtuneError), "exit_code": getattr(err, "exit_code", None),
                "message": str(err)}
    return {"user_error": False, "exit_code": 0, "message": "no error"}


@pytest.mark.parametrize("where,stage", [("train_step", "train"), ("build_model", "load")])
def test_out_of_memory_names_stage_planned_peak_and_the_flags_that_need_less(root, where, stage):
    options = run_options(root, f"oom-{stage}", strategy="single", dtype="fp32", steps=2, **{
        "batch-size": 4, "micro-batch-size": 4, "seq-len": 64, "memory-per-rank": "8GiB"})
    result = run_ranks(run_out_of_memory, 1, options, where)[0]
    message = result["message"]
    assert result["user_error"] and result["exit_code"] == 2, message  # not exit 3, "most likely a bug"
    assert message.startswith(f"rank 0 ran out of memory in stage '{stage}' (torch: {TORCH_SAYS})"), message
    assert "The planner predicted a peak of " in message and "for this setting (single, micro-batch 4, " \
        "activation checkpointing off; rows of --seq-len 64) against 8 GiB per rank (--memory-per-rank 8GiB)" in message
    assert "predicted to fit: " in message
    assert "--activation-checkpointing (" in message and "--micro-batch-size 2 (" in message
