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


def exchanged_on_ranks(rank: int, world_size: int) -> dict:
    """Generation's use of row-sharded tables (``exchanged``): each rank its own ids (as many as every other
    rank's: generation pads every rank's prompts alike) and its own last hidden states; what a rank holds
    meanwhile."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh

    from shardtune.parallel.sharded_embeddings import ShardedEmbedding, ShardedHead, exchanged, shard_rows
    from shardtune.runtime import distributed
    from shardtune.runtime.compat import LiveBytes

    distributed.init_worker()
    torch.manual_seed(0)
    dense = nn.Embedding(6001, 64).requires_grad_(False)  # 6001 rows over 3 ranks: 2001, 2000, 2000
    projection = nn.Linear(64, 6001, bias=False).requires_grad_(False)
    projection.weight = dense.weight  # tied, as generation's usual table
    mesh = init_device_mesh("cpu", (world_size,))
    weight = shard_rows(dense.weight, mesh)
    model = nn.ModuleList([ShardedEmbedding(dense, weight, mesh.get_group()),
                           ShardedHead(projection, weight, mesh.get_group())])
    ids = (torch.arange(4 * 7).reshape(4, -1) * (1499 + rank)) % 6001  # as many on each rank (generation pads)
    torch.manual_seed(10 + rank)
    hidden = torch.randn(4, 1, 64)
    with torch.no_grad(), exchanged(model), LiveBytes() as live:
        looked_up = model[0](ids)
        logits = model[1](hidden)
    after = (model[0].exchange, model[1].exchange)
    distributed.teardown()
    return {"exact": torch.equal(looked_up, dense(ids)), "logits": logits, "dense": projection(hidden),
            "peak": live.peak, "table": dense.weight.nbytes, "after": after}


def test_generation_uses_row_sharded_tables_without_gathering_them():
    """Every rank's own ids and hidden states, looked up and projected on the ranks' rows: the embeddings exact,
    the logits the dense ones, and nothing near a table held beside the rank's rows (a table gathered whole was
    the largest thing kept while generating; here the logits are)."""
    for r in run_ranks(exchanged_on_ranks, WORLD):
        assert r["exact"]
        torch.testing.assert_close(r["logits"], r["dense"], rtol=1e-6, atol=1e-6)
        assert r["peak"] < r["table"] / 4
        assert r["after"] == (False, False)


def training_on_ranks(rank: int, world_size: int) -> dict:
    """Training's use of row-sharded tables, each rank with its own number of tokens (7, 13, none;
    3000, 1100, none): the lookup
    and the loss head (softcapped, scaled) with few tokens, and with many; broadcasts and exchanges' pieces
    counted."""
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh

    from shardtune.model.head import Transform
    from shardtune.parallel import sharded_embeddings
    from shardtune.parallel.sharded_embeddings import ShardedEmbedding, ShardedHead, shard_rows
    from shardtune.runtime import distributed
    from shardtune.runtime.compat import LiveBytes
    from shardtune.train import target_logprobs
    from shardtune.train.data.records import IGNORE

    distributed.init_worker()
    broadcasts = []
    broadcast = dist.broadcast
    dist.broadcast = lambda tensor, *a, **k: broadcasts.append(tensor.numel()) or broadcast(tensor, *a, **k)
    pieces = {}  # per table, the tokens per rank of one exchange, as the runtime sized it
    exchange_piece = sharded_embeddings.exchange_piece
    sharded_embeddings.exchange_piece = lambda module, cost: pieces.setdefault(
        "embed" if isinstance(module, ShardedEmbedding) else "head", exchange_piece(module, cost))
    torch.manual_seed(0)
    dense = nn.Embedding(6001, 64).requires_grad_(False)  # 6001 rows over 3 ranks: 2001, 2000, 2000
    projection = nn.Linear(64, 6001, bias=False).requires_grad_(False)
    mesh = init_device_mesh("cpu", (world_size,))
    embed = ShardedEmbedding(dense, shard_rows(dense.weight, mesh), mesh.get_group())
    head = ShardedHead(projection, shard_rows(projection.weight, mesh), mesh.get_group())
    t = Transform(scale=0.7, softcap=3.0)
    g = torch.Generator().manual_seed(rank)
    out: dict = {}
    cases = {"few": [7, 13, 0], "pieces": [400, 250, 0], "many": [3000, 1100, 0]}
    for case, tokens in ((name, counts[rank]) for name, counts in cases.items()):
        ids = torch.randint(0, 6001, (1, tokens), generator=g)
        hidden = torch.randn(1, tokens, 64, generator=g, requires_grad=True)
        targets = torch.randint(0, 6001, (1, tokens), generator=g)
        targets[0, :3] = IGNORE
        upstream = torch.rand(1, tokens, generator=g)  # an objective's per-token weights
        broadcasts.clear()
        pieces.clear()
        looked_up = embed(ids)
        chosen = target_logprobs.exchange_size(head, hidden)
        with LiveBytes() as held:
            logps, correct = (target_logprobs.ExchangedTargetLogProbs.apply(hidden, targets, head, t, 5, chosen)
                              if chosen is not None else
                              target_logprobs.TargetLogProbs.apply(hidden, targets, head.blocks, None, t, 5, False))
            (logps * upstream).sum().backward()
        moved = sum(broadcasts)
        results = {"exact": torch.equal(looked_up, dense(ids)), "chosen": chosen, "moved": moved,
                   "pieces": dict(pieces), "logps": logps.detach(), "correct": correct, "grad": hidden.grad.clone(),
                   "peak": held.peak}
        hidden.grad = None
        with LiveBytes() as held:
            broadcast_logps, broadcast_correct = target_logprobs.TargetLogProbs.apply(hidden, targets, head.blocks,
                                                                                      None, t, 5, False)
            (broadcast_logps * upstream).sum().backward()
        results["broadcast"] = (broadcast_logps.detach(), broadcast_correct, hidden.grad.clone())
        results["broadcast_peak"] = held.peak
        hidden.grad = None
        z = 3.0 * torch.tanh(0.7 * (hidden @ projection.weight.T) / 3.0)
        dense_logps = z.log_softmax(-1).gather(-1, targets.clamp(min=0)[..., None]).squeeze(-1)
        dense_logps = dense_logps.where(targets != IGNORE, 0.0)
        (dense_logps * upstream).sum().backward()
        results["dense"] = (dense_logps.detach(), (z.argmax(-1) == targets) & (targets != IGNORE), hidden.grad)
        out[case] = results
    distributed.teardown()
    out["table"] = dense.weight.numel()
    return out


def test_training_exchanges_a_few_tokens_instead_of_broadcasting_the_tables():
    """A few tokens per rank (GRPO's case): the lookup and the loss head move the tokens, not the tables' rows
    (no broadcast at all), and give the dense embeddings (exactly), log-probabilities, accuracy and hidden
    states' gradient, as the broadcast path does; ranks with different numbers of tokens, one with none.
    More tokens are exchanged a piece at a time, holding no more than the broadcasts would; many: the rows are
    broadcast instead, with the same results. The planner (train/memory_model.py) decides each case as the run
    did: which way, and the size of the pieces whose buffers it counts."""
    from shardtune.parallel.sharded_embeddings import lookup_cost, planned_piece
    from shardtune.train.target_logprobs import scoring_cost

    results = run_ranks(training_on_ranks, WORLD)
    most = {"few": 13, "pieces": 400, "many": 3000}
    for case, tokens in most.items():
        planned = {"embed": planned_piece(6001, 64, 4, WORLD, tokens, lookup_cost(64, 4)),
                   "head": planned_piece(6001, 64, 4, WORLD, tokens, scoring_cost(64, 4, WORLD, grad=True))}
        for r in results:
            # a piece of more tokens than any rank has is all of them
            ran = {table: min(piece, tokens) for table, piece in r[case]["pieces"].items()}
            assert {table: piece for table, piece in planned.items() if piece} == ran, case
    assert results[0]["pieces"]["pieces"]["head"] < 400  # the case that is exchanged a piece at a time
    for rank, r in enumerate(results):
        few, pieces, many = r["few"], r["pieces"], r["many"]
        assert few["chosen"] == 13 and few["moved"] == 0
        assert pieces["chosen"] == 400 and pieces["moved"] == 0
        if rank < 2:  # with tokens of its own, a rank holds no more than broadcasting would (a piece at a time)
            assert pieces["peak"] <= pieces["broadcast_peak"]
        assert many["chosen"] is None and many["moved"] >= 2 * r["table"] * 2 // 3  # both tables' other rows
        for case in (few, pieces, many):
            assert case["exact"]
            for want in (case["broadcast"], case["dense"]):
                torch.testing.assert_close(case["logps"], want[0], rtol=1e-5, atol=1e-5)
                assert torch.equal(case["correct"], want[1])
                torch.testing.assert_close(case["grad"], want[2], rtol=1e-4, atol=1e-6)
        assert few["logps"].numel() == [7, 13, 0][rank]
