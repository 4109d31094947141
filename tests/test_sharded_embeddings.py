"""FSDP2 uses frozen embedding tables from row shards: same logits and gradients, one table never whole."""

from __future__ import annotations

import pytest
import torch

from dist_utils import run_ranks
from tiny import VOCAB, make_model

WORLD = 3  # 320 rows do not split evenly over 3 ranks: 107, 107, 106


def rank_input(rank: int) -> torch.Tensor:
    """Different token ids on each rank, covering every rank's rows of the vocabulary."""
    return (torch.arange(2 * 16).reshape(2, 16) * (37 + 10 * rank) + rank) % VOCAB


def build_on_ranks(rank: int, world_size: int, model_dir: str, modules_to_save: str) -> dict:
    from torch.distributed.fsdp import FSDPModule

    from shardtune.config import build_config
    from shardtune.model.structure import embedding_tables
    from shardtune.parallel.sharded_embeddings import ShardedEmbedding, ShardedHead
    from shardtune.parallel.sharded_model import build_model
    from shardtune.runtime import distributed
    from shardtune.train.resolve import resolve_on

    worker = distributed.init_worker()
    cfg = build_config({"model": model_dir, "dtype": "fp32", "strategy": "fsdp2", "seed": 3,
                        "lora-modules-to-save": modules_to_save})
    built = build_model(cfg, worker, resolve_on(worker, cfg, batches=False))
    embed, head, _ = embedding_tables(built.model)
    built.model.eval()
    with torch.no_grad():
        logits = built.model(input_ids=rank_input(rank)).logits
    out = {
        "logits": logits,
        "embed_by_rows": isinstance(embed, ShardedEmbedding),
        "head_by_rows": isinstance(head, ShardedHead),
        "head_in_fsdp_unit": isinstance(head, FSDPModule),
        "head_rows_here": head.weight.to_local().shape[0] if isinstance(head, ShardedHead) else None,
    }
    distributed.teardown()
    return out


@pytest.mark.parametrize("arch,tied", [("llama", False), ("gpt2", True)])
def test_frozen_tables_are_used_from_row_shards_and_give_from_pretrained_logits(tmp_path, arch, tied):
    from transformers import AutoModelForCausalLM

    d = str(make_model(tmp_path / "model", arch, tied))
    results = run_ranks(build_on_ranks, WORLD, d, "")
    reference = AutoModelForCausalLM.from_pretrained(d).eval()
    for rank, r in enumerate(results):
        assert r["embed_by_rows"] and r["head_by_rows"] and not r["head_in_fsdp_unit"]
        assert r["head_rows_here"] == [107, 107, 106][rank]
        with torch.no_grad():
            expected = reference(input_ids=rank_input(rank)).logits
        torch.testing.assert_close(r["logits"], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tied", [False, True])
def test_a_trained_head_stays_in_an_fsdp_unit(tmp_path, tied):
    """peft's modules_to_save copy of lm_head trains, so FSDP keeps it; a tied copy loads from the
    embedding (the checkpoint has no lm_head.weight), and a tied input table stays with it."""
    from transformers import AutoModelForCausalLM

    d = str(make_model(tmp_path / "model", "llama", tied=tied))
    results = run_ranks(build_on_ranks, 2, d, "lm_head")
    reference = AutoModelForCausalLM.from_pretrained(d).eval()
    for rank, r in enumerate(results):
        assert not r["head_by_rows"] and r["embed_by_rows"] == (not tied)
        with torch.no_grad():
            expected = reference(input_ids=rank_input(rank)).logits
        torch.testing.assert_close(r["logits"], expected, rtol=1e-5, atol=1e-5)


def head_gradient_on_ranks(rank: int, world_size: int) -> dict:
    """The output projection's forward and input gradient from row shards, against dense math."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh

    from shardtune.parallel.sharded_embeddings import ShardedHead, shard_rows
    from shardtune.runtime import distributed

    distributed.init_worker()
    torch.manual_seed(0)
    dense = nn.Linear(8, 11, bias=False).requires_grad_(False)  # 11 rows over 3 ranks: 4, 4, 3
    mesh = init_device_mesh("cpu", (world_size,))
    head = ShardedHead(dense, shard_rows(dense.weight, mesh), mesh.get_group())
    torch.manual_seed(1 + rank)
    hidden = torch.randn(2, 5, 8, requires_grad=True)
    upstream = torch.randn(2, 5, 11)
    (head(hidden) * upstream).sum().backward()
    grad_sharded, out_sharded = hidden.grad.clone(), head(hidden).detach()
    hidden.grad = None
    (dense(hidden) * upstream).sum().backward()
    distributed.teardown()
    return {"sharded": (out_sharded, grad_sharded), "dense": (dense(hidden).detach(), hidden.grad)}


def test_sharded_head_gradient_equals_the_dense_one():
    for r in run_ranks(head_gradient_on_ranks, WORLD):
        for got, want in zip(r["sharded"], r["dense"]):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def whole_table_on_ranks(rank: int, world_size: int) -> dict:
    """``kept_whole`` gathers a row-sharded table for a whole generation: what it holds meanwhile."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh

    from shardtune.parallel.sharded_embeddings import ShardedEmbedding, kept_whole, shard_rows
    from shardtune.runtime import distributed
    from shardtune.runtime.compat import LiveBytes

    distributed.init_worker()
    torch.manual_seed(0)
    dense = nn.Embedding(1000, 64).requires_grad_(False)  # 1000 rows over 3 ranks: 334, 333, 333
    mesh = init_device_mesh("cpu", (world_size,))
    embed = nn.ModuleList([ShardedEmbedding(dense, shard_rows(dense.weight, mesh), mesh.get_group())])
    ids = torch.arange(1000).reshape(4, 250)
    with LiveBytes() as live, kept_whole(embed):
        held = live.live
        looked_up = embed[0](ids)
    distributed.teardown()
    return {"held": held, "table": dense.weight.nbytes, "exact": torch.equal(looked_up, dense(ids))}


def test_a_table_kept_whole_holds_the_table_and_nothing_more():
    """While generation keeps a table whole, a rank holds the table alone: not also the buffer its owners'
    rows were broadcast through (a third of the table here), which a loop variable once kept alive."""
    for r in run_ranks(whole_table_on_ranks, WORLD):
        assert r["exact"]
        assert r["held"] == r["table"]
