"""FSDP2's all-gather through shared memory on one host (CPU): what every rank reads, when buffers are
reused, the fallback to gloo where memory cannot be shared, and a clear error instead of a hang."""

from __future__ import annotations

import time

import pytest
import torch

from shardtune.runtime import cpu_tuning

from dist_utils import run_ranks
from tiny import make_model

host_gather = pytest.importorskip("shardtune.parallel.host_gather")
pytestmark = pytest.mark.skipif(not cpu_tuning.shared_gather_supported(), reason="needs Linux memfd on an x86 CPU")


def gathers(rank: int, world_size: int, other_host_rank: int | None = None) -> dict:
    """Gathers as FSDP2 makes them, four of each of three sizes and dtypes in turn: wait for one and
    copy it out, then start the next (the prefetch), so that one is written while another is read."""
    from torch import distributed as dist

    from shardtune.runtime import distributed

    distributed.init_worker()
    if rank == other_host_rank:
        host_gather._host = lambda: ("elsewhere", "another boot")
    gather = host_gather.SharedMemoryAllGather(dist.group.WORLD)
    sizes = [(5, torch.bfloat16)] * 4 + [(12, torch.float32)] * 4 + [(7, torch.uint8)] * 4
    wrong, started = [], None

    def copy_out(step: int, n: int, dtype: torch.dtype, out: torch.Tensor, work: dist.Work) -> None:
        work.wait()
        expected = torch.cat([torch.arange(n) + 10 * r + step for r in range(world_size)]).to(dtype)
        if not torch.equal(out, expected):
            wrong.append(step)

    for step, (n, dtype) in enumerate(sizes):
        if started:
            copy_out(*started)
        out = gather.allocate((n * world_size,), dtype=dtype, device=torch.device("cpu"))
        # FSDP2 copies this rank's shard into its part of the output, then calls the gather.
        mine = out.narrow(0, rank * n, n)
        mine.copy_(torch.arange(n) + 10 * rank + step)
        started = (step, n, dtype, out, gather(output_tensor=out, input_tensor=mine, group=dist.group.WORLD,
                                               async_op=True))
    copy_out(*started)
    pools = {nbytes: (pool.shared, len(pool.buffers)) for nbytes, pool in gather.pools.items()}
    distributed.teardown()
    return {"wrong": wrong, "pools": pools}


@pytest.mark.parametrize("world_size", [2, 3])
def test_every_rank_reads_every_part_and_buffers_are_reused(world_size):
    for r in run_ranks(gathers, world_size):
        assert r["wrong"] == []
        # a pool per size, of two shared buffers taken in turn: four gathers of a size reuse them
        assert sorted(r["pools"].values()) == [(True, 2)] * 3


def test_ranks_on_different_hosts_gather_through_gloo():
    """Where a rank is elsewhere, its /proc is another machine's: every rank falls back, together."""
    for r in run_ranks(gathers, 2, 1):
        assert r["wrong"] == []
        assert sorted(r["pools"].values()) == [(False, 0)] * 3


def one_rank_stops(rank: int, world_size: int) -> str:
    from torch import distributed as dist

    from shardtune.runtime import distributed

    distributed.init_worker()
    gather = host_gather.SharedMemoryAllGather(dist.group.WORLD, timeout_s=1.0)
    out = gather.allocate((4,), dtype=torch.float32, device=torch.device("cpu"))
    message = ""
    if rank == 0:  # rank 1 never writes its part: it failed between allocating and gathering
        work = gather(output_tensor=out, input_tensor=out.narrow(0, 0, 2), group=dist.group.WORLD)
        start = time.monotonic()
        try:
            work.wait()
        except host_gather.GatherTimeout as err:
            message = f"{err} after {time.monotonic() - start:.1f}"
    dist.barrier()
    distributed.teardown()
    return message


def test_a_rank_that_never_gathers_is_an_error_not_a_hang():
    message = run_ranks(one_rank_stops, 2, timeout=120)[0]
    assert "rank 0 of 2" in message and "write their parts of use 1" in message
    assert "within 1 s" in message and "failed or hangs" in message


def fsdp2_gradients(rank: int, world_size: int, model_dir: str) -> dict:
    from shardtune.config import build_config
    from shardtune.parallel.sharded_model import build_model
    from shardtune.runtime import distributed
    from shardtune.train.resolve import resolve_on

    worker = distributed.init_worker()
    cfg = build_config({"model": model_dir, "dtype": "fp32", "strategy": "fsdp2", "fsdp-unit": "layer", "seed": 3})
    built = build_model(cfg, worker, resolve_on(worker, cfg, batches=False))
    model, strategy = built.model.train(), built.strategy
    ids = torch.arange(16).reshape(1, 16) * (rank + 1) % 200
    model(input_ids=ids, labels=ids).loss.backward()
    grads = {n: p.grad.full_tensor().clone() for n, p in strategy.trainable(model).items()}
    pools = {nbytes: (pool.shared, len(pool.buffers)) for nbytes, pool in getattr(strategy.gather, "pools", {}).items()}
    distributed.teardown()
    return {"grads": grads, "pools": pools, "gather": type(strategy.gather).__name__}


def test_fsdp2_gathers_through_shared_memory_with_the_same_gradients(tmp_path, monkeypatch):
    """FSDP2 on the CPU gathers every unit through shared buffers, and its gradients are bit for bit
    those of gathering through gloo (``SHARDTUNE_SHARED_GATHER=0``)."""
    model_dir = str(make_model(tmp_path / "model", "llama"))
    shared = run_ranks(fsdp2_gradients, 2, model_dir)
    monkeypatch.setenv("SHARDTUNE_SHARED_GATHER", "0")
    through_gloo = run_ranks(fsdp2_gradients, 2, model_dir)
    for s, g in zip(shared, through_gloo):
        assert s["gather"] == "SharedMemoryAllGather" and g["gather"] == "BroadcastAllGather"
        assert s["pools"] and all(is_shared and n <= 2 for is_shared, n in s["pools"].values())
        assert s["grads"].keys() == g["grads"].keys()
        for name, grad in g["grads"].items():
            assert torch.equal(s["grads"][name], grad), name
    # The planner's "buffers" term is what the run really kept in shared gather buffers (not a formula restated)
    from shardtune.config import build_config
    from shardtune.train.choice import strategy_rows

    cfg = build_config({"model": model_dir, "dtype": "fp32", "strategy": "fsdp2", "fsdp-unit": "layer", "nproc": 2})
    monkeypatch.delenv("SHARDTUNE_SHARED_GATHER")
    kept = sum(nbytes * n for nbytes, (_, n) in shared[0]["pools"].items())
    assert strategy_rows(cfg, 1 << 40)["fsdp2"][0].terms["buffers"] * 2**20 == pytest.approx(kept, rel=0.05)
