"""HSDP (--replicate-groups): shard within groups, replicate across them; equal to 1 rank; resumable as FSDP."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from test_equivalence import grads_and_training

import cli_process
from dist_utils import finetune_on_ranks, free_port, run_ranks
from tiny import make_run_dir, run_options


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return make_run_dir(tmp_path_factory.mktemp("hsdp"))


def _options(root: Path, out: str, **extra) -> dict:
    return run_options(root, out, **{"dtype": "fp32", "steps": 4, "batch-size": 8, "lr": 1e-2,
                                     "warmup-steps": 1, "seed": 1, **extra})


def hsdp_training(rank: int, world_size: int, options: dict) -> dict:
    """grads_and_training, with FSDP1's gradients read from its flat shards (names are not parameters there)."""
    if options["strategy"] != "fsdp1":
        return grads_and_training(rank, world_size, options)
    from shardtune.config import build_config
    from shardtune.parallel.fsdp1 import gather_full
    from shardtune.runtime import distributed
    from shardtune.runtime.memory import MemoryMonitor
    from shardtune.train.adapter import save_adapter
    from shardtune.train.job import setup
    from shardtune.train.recipe import train

    cfg = build_config(options)
    worker = distributed.init_worker()
    memory = MemoryMonitor(worker.device)
    job = setup(cfg, worker, memory)
    job.step(0)
    grads = gather_full(job.model, list(job.built.adapter_keys.values()), grads=True)
    job.model.zero_grad(set_to_none=True)
    out = Path(cfg.output.out)
    out.mkdir(parents=True, exist_ok=True)
    result = train(job, memory, out)
    save_adapter(job.model, job.strategy, job.built.adapter_keys, out / "adapter", cfg.model.path, job.model_dir)
    memory.close()
    distributed.teardown()
    return {"grads": grads, "losses": result["losses"]}


@pytest.fixture(scope="module")
def one_rank(root) -> dict:
    return run_ranks(grads_and_training, 1, _options(root, "one", strategy="single", **{"micro-batch-size": 8}))[0]


def _adapter(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(out / "adapter" / "adapter_model.safetensors")


def _assert_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert set(a) == set(b) and a
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-6, msg=k)


@pytest.mark.parametrize("strategy", ["fsdp2", "fsdp1"])
def test_four_ranks_in_two_replica_groups_equal_one_rank(root, one_rank, strategy):
    four = run_ranks(hsdp_training, 4, _options(root, f"hsdp-{strategy}", strategy=strategy,
                                                     **{"micro-batch-size": 1, "replicate-groups": 2}),
                     timeout=600)
    for rank in (0, 3):  # one rank of each replica group
        for name, g in one_rank["grads"].items():
            # a gradient not all-reduced across the groups would be half of it (or the other group's)
            torch.testing.assert_close(four[rank]["grads"][name], g, rtol=1e-4, atol=1e-6, msg=name)
    torch.testing.assert_close(torch.tensor(four[0]["losses"]), torch.tensor(one_rank["losses"]),
                               rtol=1e-5, atol=1e-6)
    _assert_close(_adapter(root / "one"), _adapter(root / f"hsdp-{strategy}"))


def test_nf4_in_two_replica_groups_loads_and_equals_one_rank(tmp_path):
    """QLoRA across nodes: each group quantizes its rows with the scaler mean of its own group's rows
    (the sharded mesh dimension; a 2-D mesh has no single group, which loading once asked it for)."""
    from tiny import instruction_records, make_model, write_jsonl

    model = make_model(tmp_path / "model", "llama", hidden=64, row_scales=True)
    data = write_jsonl(tmp_path / "train.jsonl", instruction_records(16))
    options = {"model": str(model), "data": str(data), "dtype": "fp32", "steps": 2, "batch-size": 8, "lr": 1e-2,
               "warmup-steps": 1, "seed": 1, "quantize": "nf4", "lora-targets": "q_proj,v_proj"}
    one = run_ranks(grads_and_training, 1, {**options, "out": str(tmp_path / "one"), "strategy": "single",
                                            "micro-batch-size": 8})[0]
    four = run_ranks(grads_and_training, 4, {**options, "out": str(tmp_path / "hsdp"), "strategy": "fsdp2",
                                             "micro-batch-size": 2, "replicate-groups": 2}, timeout=600)
    torch.testing.assert_close(four[0]["before"], one["before"], rtol=1e-5, atol=1e-5)  # the same 4-bit base
    for rank in (0, 3):
        for name, g in one["grads"].items():
            torch.testing.assert_close(four[rank]["grads"][name], g, rtol=1e-4, atol=1e-6, msg=name)
    torch.testing.assert_close(torch.tensor(four[0]["losses"]), torch.tensor(one["losses"]), rtol=1e-5, atol=1e-6)


def _flags(options: dict) -> list[str]:
    return [part for key, value in options.items() for part in (f"--{key}", str(value))]


def test_two_loopback_nodes_hsdp_give_the_one_rank_adapter_and_resume_as_plain_fsdp(root, one_rank):
    """2 "nodes" x 2 processes, one replica group per node, one --out shared by both nodes."""
    options = _options(root, "nodes", strategy="fsdp2", **{"micro-batch-size": 1, "save-every": 2})
    endpoint = f"127.0.0.1:{free_port()}"
    runs = [cli_process.command(["finetune", *_flags(options), "--nproc", "2", "--nnodes", "2", "--node-rank", str(i),
                                 "--rdzv-endpoint", endpoint, "--replicate-groups", "2"]) for i in (0, 1)]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for cmd in runs]
    logs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs
    assert "train_loss_last" in logs[0] and "train_loss_last" not in logs[1]  # node 0 reports, once
    out = root / "nodes"
    config = (out / "config.yaml").read_text()
    assert "node-rank: 0" in config and "replicate-groups: 2" in config  # node 0's, not overwritten by node 1
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 4 and len(summary["train_peak_mb"]) == 4
    _assert_close(_adapter(root / "one"), _adapter(out))

    # The HSDP checkpoint of step 2 continues as plain FSDP2 on 2 ranks, to the same adapter.
    import shutil

    resumed = root / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(out / "checkpoints" / "step-2", resumed / "checkpoints" / "step-2")
    summary = finetune_on_ranks(_options(root, "resumed", strategy="fsdp2", resume=True), 2)  # torchrun-style
    assert summary["resumed_from_step"] == 2
    _assert_close(_adapter(root / "one"), _adapter(resumed))


def test_resume_command_names_the_node():
    from shardtune.train.checkpoint_files import resume_command

    assert resume_command(Path("o")) == "shardtune finetune --config o/config.yaml --resume"
    # node 1 resuming with node 0's config.yaml must say it is node 1
    assert resume_command(Path("o"), 2, 1) == "shardtune finetune --config o/config.yaml --node-rank 1 --resume"


def test_hsdp_options_are_checked_and_the_planner_shards_within_a_group(root):
    from shardtune.config import ConfigError, build_config, validate
    from shardtune.train.choice import strategy_rows

    with pytest.raises(ConfigError, match="'replicate-groups': 3 groups do not divide the 4 ranks"):
        validate(build_config({"model": "m", "data": "d", "out": "o", "nproc": 4, "replicate-groups": 3}))
    with pytest.raises(ConfigError, match="'replicate-groups' needs an FSDP strategy"):
        validate(build_config({"model": "m", "data": "d", "out": "o", "nproc": 4, "replicate-groups": 2,
                               "strategy": "ddp"}))
    nodes = {"model": str(root / "model"), "data": "d", "out": "o", "nproc": 2, "nnodes": 2, "node-rank": 0,
             "rdzv-endpoint": "h:1"}
    fsdp = strategy_rows(build_config(nodes), 1 << 40)
    hsdp = strategy_rows(build_config({**nodes, "replicate-groups": 2}), 1 << 40)
    for strategy in ("fsdp2", "fsdp1"):
        plain, hybrid = fsdp[strategy][0], hsdp[strategy][0]
        assert (plain.ranks, hybrid.ranks) == (4, 2)  # a rank holds 1/4 of the weights, or 1/2 of them under HSDP
        assert hybrid.terms["weights"] == pytest.approx(2 * plain.terms["weights"])
