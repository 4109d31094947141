"""--dtype fp16: loss scaling with torch's sharded grad scaler, N ranks like 1 rank, inf steps skipped everywhere
(in the loop too: an overflow is a skipped, counted step), and fp16 runs planned for every strategy."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from dist_utils import run_ranks, trained_job
from tiny import make_run_dir, run_options


@pytest.fixture(scope="module")
def setup_dir(tmp_path_factory) -> Path:
    return make_run_dir(tmp_path_factory.mktemp("fp16"), tied=True, records=16)


def fp16_training(rank: int, world_size: int, options: dict) -> dict:
    """A short fp16 run; then one step whose gradient is inf on the last rank only."""
    from torch.distributed.tensor import DTensor

    from shardtune.runtime import distributed

    job, memory, result = trained_job(options)
    scale_after_training = job.scaler.get_scale()

    params = list(job.strategy.trainable(job.model).values())
    optimizer = torch.optim.SGD(params, lr=1.0)

    def full(t):
        return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()

    before = [full(p) for p in params]
    for p in params:
        p.grad = torch.zeros_like(p)
    if rank == world_size - 1:
        local = params[0].grad.to_local() if isinstance(params[0].grad, DTensor) else params[0].grad
        if local.numel():
            local.view(-1)[0] = float("inf")
    job.scaler.unscale_(optimizer)
    job.scaler.step(optimizer)
    job.scaler.update()
    unchanged = all(torch.equal(full(p), b) for p, b in zip(params, before))
    memory.close()
    distributed.teardown()
    return {"losses": result["losses"], "scale": scale_after_training, "scale_after_inf": job.scaler.get_scale(),
            "skipped": unchanged, "dtypes": sorted({str(p.dtype) for p in params})}


def _options(root: Path, out: str, **extra) -> dict:
    return run_options(root, out, **{"dtype": "fp16", "steps": 3, "batch-size": 4, "lr": 1e-2,
                                     "warmup-steps": 1, "seed": 1, **extra})


def test_fp16_two_ranks_fsdp2_match_one_rank_and_skip_inf_steps_on_every_rank(setup_dir):
    one = run_ranks(fp16_training, 1, _options(setup_dir, "one", strategy="single", **{"micro-batch-size": 4}))
    two = run_ranks(fp16_training, 2, _options(setup_dir, "two", strategy="fsdp2", **{"micro-batch-size": 1}))
    # fp16 compute: agreement to fp16 tolerance, not bit-exact (sums happen in other orders)
    torch.testing.assert_close(torch.tensor(two[0]["losses"]), torch.tensor(one[0]["losses"]), rtol=2e-3, atol=2e-3)
    for r in one + two:
        assert r["dtypes"] == ["torch.float32"]  # LoRA weights and their optimizer stay fp32
        assert r["scale"] == 2.0**16  # enabled, and no overflow in a healthy run
        # an inf on one rank's shard: every rank skips the step and halves the scale
        assert r["skipped"] and r["scale_after_inf"] == 2.0**15


def test_scaler_is_off_for_bf16():
    from shardtune.train.scaling import make_scaler

    assert not make_scaler("bf16", torch.device("cpu")).is_enabled()
    assert make_scaler("fp16", torch.device("cpu")).is_enabled()


# --- fp16 through the planner: what --dtype auto picks on GPUs without bf16 (T4, V100) ---------------

PLANNED = {"nproc": 2, "batch-size": 4, "seq-len": 128, "lora-r": 4}


def _flags(options: dict) -> list[str]:
    return [f for k, v in options.items() for f in (f"--{k}", str(v))]


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_plan_with_fp16_predicts_every_strategy(setup_dir, capsys, device):
    """The fake-tensor pass saves its activations under fp16 too (a KeyError at (4, bfloat16) was the
    first thing every fp16 user met); ``plan --device cuda`` plans for a T4 from this CPU machine."""
    import json

    from shardtune import cli

    flags = ["plan", "--model", str(setup_dir / "model"), "--data", str(setup_dir / "train.jsonl"),
             "--dtype", "fp16", "--device", device, "--memory-per-rank", "8GiB", *_flags(PLANNED), "--json"]
    assert cli.main(flags) == 0, capsys.readouterr().err
    doc = json.loads(capsys.readouterr().out)
    for strategy in ("fsdp2", "fsdp1", "ddp", "single"):
        assert doc[strategy]["terms"]["activations"] > 0 and doc[strategy]["fits"], strategy


@pytest.mark.parametrize("strategy", ["auto", "fsdp2", "fsdp1", "ddp", "single"])
def test_finetune_with_fp16_passes_preflight_for_every_strategy(setup_dir, monkeypatch, strategy):
    """Each strategy's fp16 fine-tune is planned (preflight) and handed to the launcher."""
    import shardtune.launch
    from shardtune import cli

    launched = []

    def launch(cfg, plan, asked=None):
        launched.append((cfg.model.dtype, plan.strategy))
        return {}

    monkeypatch.setattr(shardtune.launch, "launch", launch)
    options = {**PLANNED, "nproc": 1 if strategy == "single" else 2, "strategy": strategy}
    code = cli.main(["finetune", "--model", str(setup_dir / "model"), "--data", str(setup_dir / "train.jsonl"),
                     "--out", str(setup_dir / f"pre-{strategy}"), "--dtype", "fp16", *_flags(options)])
    assert code == 0 and len(launched) == 1 and launched[0][0] == "fp16"
    assert strategy == "auto" or launched[0][1] == strategy


# --- gradient overflow inside the training loop ------------------------------------------------------

def overflowing_training(rank: int, world_size: int, options: dict, overflow_at: list[int],
                         max_in_a_row: int | None) -> dict:
    """The recipe's own loop (``train``), with the gradient of one LoRA weight made inf in the backward
    passes ``overflow_at`` (1-based): what the dynamic scaler meets when its scale has grown too far."""
    import json

    from shardtune.config import build_config
    from shardtune.runtime import distributed
    from shardtune.runtime.memory import MemoryMonitor
    from shardtune.train import guard
    from shardtune.train.guard import Diverged
    from shardtune.train.job import setup
    from shardtune.train.recipe import train

    if max_in_a_row is not None:
        guard.MAX_OVERFLOWS_IN_A_ROW = max_in_a_row
    cfg = build_config(options)
    worker = distributed.init_worker()
    memory = MemoryMonitor(worker.device)
    job = setup(cfg, worker, memory)
    backwards = [0]

    def overflow(grad: torch.Tensor) -> torch.Tensor:
        backwards[0] += 1
        return torch.full_like(grad, float("inf")) if backwards[0] in overflow_at else grad

    next(iter(job.strategy.trainable(job.model).values())).register_hook(overflow)
    out = Path(cfg.output.out)
    out.mkdir(parents=True, exist_ok=True)
    error = None
    try:
        train(job, memory, out)
    except Diverged as err:
        error = str(err)
    memory.close()
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"metrics": metrics, "error": error}


def test_an_fp16_overflow_in_the_loop_is_a_skipped_step_not_a_divergence(setup_dir):
    options = _options(setup_dir, "overflow", strategy="single", steps=5, **{"micro-batch-size": 4})
    run = run_ranks(overflowing_training, 1, options, [2, 3], None)[0]
    assert run["error"] is None, run["error"]
    metrics = run["metrics"]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5]  # the run went on to its end
    assert [m["skipped_steps"] for m in metrics] == [0, 1, 2, 2, 2]
    # each overflow halved the scale; the steps after it trained on
    assert [m["loss_scale"] for m in metrics] == [2.0**16, 2.0**15, 2.0**14, 2.0**14, 2.0**14]
    assert metrics[1]["grad_norm"] is None and all(math.isfinite(m["loss"]) for m in metrics)
    assert metrics[-1]["loss"] < metrics[0]["loss"]


def test_fp16_overflowing_step_after_step_is_a_divergence(setup_dir):
    options = _options(setup_dir, "collapse", strategy="single", steps=6, **{"micro-batch-size": 4})
    run = run_ranks(overflowing_training, 1, options, list(range(2, 7)), 3)[0]
    assert run["error"] and "training diverged at step 4" in run["error"], run["error"]
    assert "overflowed at 3 steps in a row" in run["error"] and "the last at a loss scale of 16384" in run["error"]
    assert [m["step"] for m in run["metrics"]] == [1, 2, 3]


def test_the_progress_line_counts_skipped_steps_once_there_are_any():
    from shardtune.train.metrics import Progress

    progress = Progress(total=5, initial=0, enabled=True)
    record = {"loss": 1.5, "tokens_per_second": 10.0, "memory_mb": 100.0, "skipped_steps": 0}
    progress.update(record)
    assert "skipped" not in progress.bar.postfix
    progress.update({**record, "skipped_steps": 2})
    assert "skipped 2" in progress.bar.postfix
    progress.close()
