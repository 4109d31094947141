"""GRPO's generation from FSDP2's row shards (parallel/exchanged_layers.py): the completions and logits of the
gathered model, no projection ever gathered, and the model left as it was for training."""

from __future__ import annotations

import pytest
import torch

from dist_utils import run_ranks
from tiny import make_model

WORLD = 3  # the tiny model's projections do not split evenly over 3 ranks


def generate_on_ranks(rank: int, world_size: int, model_dir: str, quantize: str) -> dict:
    from torch import nn
    from torch.distributed.tensor import DTensor

    from shardtune.config import build_config
    from shardtune.parallel.sharded_model import build_model
    from shardtune.runplan import GenerationWeights
    from shardtune.runtime import compat, distributed
    from shardtune.train.generation import generate
    from shardtune.train.resolve import resolve_on
    from shardtune.train.sampling import SamplingSettings

    worker = distributed.init_worker()
    cfg = build_config({"model": model_dir, "dtype": "fp32", "strategy": "fsdp2", "seed": 3,
                        "lora-targets": "all-linear", **({"quantize": quantize} if quantize else {})})
    built = build_model(cfg, worker, resolve_on(worker, cfg, batches=False))
    model, strategy = built.model, built.strategy
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():  # LoRA's B is zero at first: give the adapter a say in the numbers
        for p in model.parameters():
            if p.requires_grad:
                full = torch.randn(p.shape, generator=g) * 0.3
                rows = full.chunk(world_size)[rank] if isinstance(p, DTensor) else full
                compat.dtensor_local(p).copy_(rows[:compat.dtensor_local(p).size(0)])

    # prompts of different widths on each rank; rank 1 has a one-token prompt
    prompts = [[(5 * rank + 3 * i + j) % 60 + 3 for j in range(1 + (i + rank) % 4 * 2)] for i in range(3)]
    keys = [(rank * 3 + i, 0) for i in range(3)]
    settings = SamplingSettings(6, (1,), 0, temperature=1.0)

    seen: list[bool] = []  # per projection call while exchanged: its weight still the rank's row shard

    def watch(module: nn.Module, args: tuple) -> None:
        seen.append(isinstance(module.weight, DTensor))

    kept = generate(model, strategy, worker, prompts, keys, settings, seed=1, step=0,
                    weights=GenerationWeights(gathered=True))
    handles = [m.register_forward_pre_hook(watch) for m in model.modules()
               if type(m) is nn.Linear and not m.weight.requires_grad]  # the base weights, LoRA's aside
    reduced = []  # all-reduces while exchanged: the widest prompt's, then one a token (the lockstep's), none a layer
    all_reduce = torch.distributed.all_reduce
    torch.distributed.all_reduce = lambda *a, **k: reduced.append(1) or all_reduce(*a, **k)
    try:
        exchanged = generate(model, strategy, worker, prompts, keys, settings, seed=1, step=0,
                             weights=GenerationWeights(exchanged=True))
    finally:
        torch.distributed.all_reduce = all_reduce
    # every rank sampling all three ranks' rows: no all-to-all, no lockstep all-reduce (only the widest prompt's
    # and the embeddings' sums, one a forward)
    calls: dict[str, int] = {"all_reduce": 0, "all_to_all_single": 0}
    originals = {name: getattr(torch.distributed, name) for name in calls}

    def counted(name: str):
        return lambda *a, **k: calls.__setitem__(name, calls[name] + 1) or originals[name](*a, **k)
    for name in calls:
        setattr(torch.distributed, name, counted(name))
    try:
        replicated = generate(model, strategy, worker, prompts, keys, settings, seed=1, step=0,
                              weights=GenerationWeights(exchanged=True, replicated=True))
    finally:
        for name, original in originals.items():
            setattr(torch.distributed, name, original)
    for h in handles:
        h.remove()

    # after: training's forward and backward run as before (hooks back, nothing shadowed)
    ids = torch.tensor([[4, 9, 12, 30, 2]])
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    leftovers = [n for n, m in model.named_modules() if {"weight", "bias", "forward"} & set(vars(m))]
    distributed.teardown()
    return {"kept": [c.ids for c in kept], "exchanged": [c.ids for c in exchanged],
            "replicated": [c.ids for c in replicated], "calls": calls, "seen": seen,
            "loss": float(loss), "leftovers": leftovers, "reduced": len(reduced), "tokens": settings.max_new_tokens}


@pytest.mark.parametrize("arch,quantize,world", [("llama", "", WORLD), ("qwen2", "", WORLD), ("llama", "nf4", 2),
                                                      ("gpt2", "", WORLD)])
def test_generation_from_row_shards_gives_the_gathered_models_completions(tmp_path, arch, quantize, world):
    """Three ranks (nf4: two, which must split its rows evenly), prompts of different widths, LoRA on every
    projection (qwen2: q, k and v with biases; nf4: 4-bit base weights; gpt2: Conv1D projections, gathered once
    instead): the exchanged generation samples the same tokens as the gathered one, no projection's weight is
    ever gathered while it runs, no token count is agreed on per layer (every rank's prompts are padded alike:
    one all-reduce for the generation, then the lockstep's one a token), and training's forward works after
    it. Every rank sampling all the ranks' rows (``replicated``), each rank gets its own rows' same completions,
    and no all-to-all runs: each projection's outputs are all-gathered."""
    d = str(make_model(tmp_path / "model", arch, row_scales=bool(quantize), hidden=64))
    results = run_ranks(generate_on_ranks, world, d, quantize)
    for r in results:
        assert r["exchanged"] == r["kept"] and r["replicated"] == r["kept"]
        assert r["calls"]["all_to_all_single"] == 0 and 0 < r["calls"]["all_reduce"] <= 1 + r["tokens"]
        assert 0 < r["reduced"] <= r["tokens"]
        assert all(r["seen"]) and (bool(r["seen"]) != (arch == "gpt2"))
        assert r["leftovers"] == []
        assert torch.isfinite(torch.tensor(r["loss"]))


def exchange_grads_on_ranks(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    from shardtune.parallel.exchange import ExchangedLinear, everyones, replicated_linears
    from shardtune.parallel.sharded_embeddings import row_counts
    from shardtune.runtime import distributed

    distributed.init_worker()
    group = dist.group.WORLD
    g = torch.Generator().manual_seed(11)
    # three layers of the same inputs exchanged at once (as q, k and v): 7, 3 and 4 rows over the ranks
    whole = [(torch.randn(n, 5, generator=g, dtype=torch.float64), torch.randn(n, generator=g, dtype=torch.float64))
             for n in (7, 3, 4)]
    rows = [row_counts(w.size(0), world_size) for w, _ in whole]
    mine = [(w[sum(r[:rank]):sum(r[:rank + 1])], b[sum(r[:rank]):sum(r[:rank + 1])]) for (w, b), r in zip(whole, rows)]
    # each rank its own tokens, a different count on each (rank 2: none at all)
    xs = [torch.randn(2, t, 5, generator=g, dtype=torch.float64) for t in (3, 1, 0)[:world_size]]
    x = xs[rank].clone().requires_grad_()
    padded = max(t.numel() // 5 for t in xs)
    everyone = everyones(x.detach().reshape(-1, 5), 0.0, group, shape=[padded, 5])
    outs = ExchangedLinear.apply(x, everyone, [w for w, _ in mine], [b for _, b in mine], rows, group)
    upstream = [torch.randn(o.shape, generator=torch.Generator().manual_seed(rank), dtype=torch.float64)
                for o in outs]
    # the third layer's outputs unused: its gradient is zeros
    sum((o * u).sum() for o, u in zip(outs[:2], upstream)).backward()
    # the same on the whole weights, this rank alone
    x_ref = xs[rank].clone().requires_grad_()
    refs = [torch.nn.functional.linear(x_ref, w, b) for w, b in whole]
    sum((o * u).sum() for o, u in zip(refs[:2], upstream)).backward()
    # the same inputs on every rank (a replicated generation): each rank's rows' outputs all-gathered
    same = torch.randn(4, 5, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    replicated = replicated_linears(same, [w for w, _ in mine], [b for _, b in mine], rows, group)
    distributed.teardown()
    return {"outs": [(o.detach(), r.detach()) for o, r in zip(outs, refs)], "grad": (x.grad, x_ref.grad),
            "replicated": [(o, torch.nn.functional.linear(same, w, b)) for o, (w, b) in zip(replicated, whole)]}


def test_exchanged_linear_gives_the_whole_weights_outputs_and_input_gradients():
    """Training through the exchange (frozen row-sharded weights, parallel/exchange.py ``ExchangedLinear``): on
    three ranks, three layers of the same inputs exchanged together, with uneven rows, a different token count on
    each rank (one with none) and one layer's outputs unused: every rank's outputs and its inputs' gradient equal
    those of the whole weights on its own tokens. With the same inputs on every rank (``replicated_linears``), every
    rank gets the whole weights' outputs."""
    for r in run_ranks(exchange_grads_on_ranks, WORLD):
        for got, want in [*r["outs"], r["grad"], *r["replicated"]]:
            assert got.shape == want.shape
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def train_on_ranks(rank: int, world_size: int, model_dir: str, exchange: bool, checkpointing: bool,
                   dtype: str = "fp32", quantize: str = "", scoring: bool = False) -> dict:
    import dataclasses

    from torch import nn
    from torch.distributed.tensor import DTensor

    from shardtune.config import build_config
    from shardtune.parallel.sharded_model import build_model
    from shardtune.runtime import compat, distributed
    from shardtune.train.resolve import resolve_on

    worker = distributed.init_worker()
    cfg = build_config({"model": model_dir, "dtype": dtype, "strategy": "fsdp2", "seed": 3,
                        "lora-targets": "all-linear", "activation-checkpointing": checkpointing,
                        **({"quantize": quantize} if quantize else {})})
    plan = dataclasses.replace(resolve_on(worker, cfg, batches=False), layers_exchanged=exchange)
    built = build_model(cfg, worker, plan)
    model = built.model
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():  # LoRA's B is zero at first: give A a gradient
        for p in model.parameters():
            if p.requires_grad:
                full = torch.randn(p.shape, generator=g) * 0.3
                rows = full.chunk(world_size)[rank] if isinstance(p, DTensor) else full
                compat.dtensor_local(p).copy_(rows[:compat.dtensor_local(p).size(0)])
    outside: list[bool] = []  # per projection call: its weight still the rank's row shard (FSDP2 gathers its own)
    for m in model.modules():
        if type(m) is nn.Linear and not m.weight.requires_grad:
            m.register_forward_pre_hook(lambda module, args: outside.append(isinstance(module.weight, DTensor)))
    ids = torch.tensor([[(7 * rank + 3 * j) % 60 + 3 for j in range(5 + rank)]])  # a different width on each rank
    with torch.no_grad():  # the first forward learns which projections read the same inputs
        model(input_ids=ids)
    from shardtune.parallel import exchanged_layers

    exchanges = []  # each all-to-all of projections' outputs: how many projections it carried
    function = exchanged_layers.ExchangedLinear

    class Counted:
        @staticmethod
        def apply(*args):
            exchanges.append(len(args[2]))
            return function.apply(*args)

    exchanged_layers.ExchangedLinear = Counted
    reduced = []  # all-reduces in the step's forward and backward
    all_reduce = torch.distributed.all_reduce
    torch.distributed.all_reduce = lambda *a, **k: reduced.append(1) or all_reduce(*a, **k)
    model.train()
    try:
        if scoring:  # as every objective's step does: the loss head scores the targets (``score``)
            from shardtune.train import loss_head
            from shardtune.train.data.records import IGNORE

            assert loss_head.install(model)
            targets = torch.full_like(ids, IGNORE)
            targets[:, :-1] = ids[:, 1:]
            scored = (targets.reshape(-1) != IGNORE).nonzero().squeeze(-1)
            loss = -loss_head.score(model, {"input_ids": ids}, targets, scored=scored).logps.mean()
        else:
            loss = model(input_ids=ids, labels=ids).loss
        exchanged_layers.ExchangedLinear = function
        loss.backward()  # recomputing under checkpointing: the hooks see those calls too
    finally:
        exchanged_layers.ExchangedLinear = function
        torch.distributed.all_reduce = all_reduce
    # nothing of the step left held by the exchange (a recompute stops before the end of the layer's forward)
    held = [m.forward.round.source is not None or bool(m.forward.round.ahead)
            for m in model.modules() if hasattr(vars(m).get("forward"), "round")]
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.requires_grad}
    distributed.teardown()
    return {"loss": loss.item(), "grads": grads, "outside": outside, "exchanges": exchanges, "held": held,
            "reduced": len(reduced)}


@pytest.mark.parametrize("checkpointing,dtype,quantize", [(False, "fp32", ""), (True, "fp32", ""),
                                                     (False, "bf16", ""), (True, "fp32", "nf4")])
def test_training_from_row_shards_gives_fsdp2s_loss_and_gradients(tmp_path, checkpointing, dtype, quantize):
    """The frozen projections left out of FSDP2 and exchanged in training (``exchange_in_place``, three ranks,
    uneven rows, a different sequence width on each rank, with and without activation checkpointing, in
    bf16 with LoRA's weights fp32 as on GPUs, and a 4-bit base on two ranks, each loading and dequantizing its
    own rows): the losses and every LoRA gradient are those of the plain FSDP2 model (bf16: to its rounding,
    the input gradients being summed over the ranks' rows in another order), with one all-reduce more: the
    token count every rank pads to, agreed on once for the model's forward."""
    d = str(make_model(tmp_path / "model", "qwen2", hidden=64, row_scales=bool(quantize)))  # q, k, v with biases
    world = 2 if quantize else WORLD  # NF4's rows split by whole blocks: evenly
    plain = run_ranks(train_on_ranks, world, d, False, checkpointing, dtype, quantize)
    exchanged = run_ranks(train_on_ranks, world, d, True, checkpointing, dtype, quantize)
    tol = {"rtol": 1e-4, "atol": 1e-6} if dtype == "fp32" else {"rtol": 5e-2, "atol": 5e-3}
    for p, e in zip(plain, exchanged):
        assert not any(p["outside"]) and e["outside"] and all(e["outside"])
        # per layer: q, k and v in one all-to-all, then o, then gate and up, then down
        assert e["exchanges"] == [3, 1, 2, 1] * 2 and p["exchanges"] == [], str(e["exchanges"])
        assert e["held"] and not any(e["held"]) and p["held"] == []
        # the token count the ranks pad to: agreed on once for the model's forward, not per layer or recompute
        assert e["reduced"] == p["reduced"] + 1, (e["reduced"], p["reduced"])
        assert e["loss"] == pytest.approx(p["loss"], rel=tol["rtol"] / 10)
        assert e["grads"].keys() == p["grads"].keys()
        for name, grad in p["grads"].items():
            torch.testing.assert_close(e["grads"][name], grad, **tol, msg=name)


@pytest.mark.parametrize("exchange", [False, True])
def test_a_scored_forward_agrees_on_its_token_counts_once(tmp_path, exchange):
    """A forward the loss head scores (every objective's step, ``score``), with the row-sharded embedding and
    head exchanging tokens and, exchanged, the layers too (three ranks, a different width on each, activation
    checkpointing): one all-reduce in its forward and backward, where the lookup, the layers and the head each
    agreed on a count of their own (parallel/agreed_counts.py), and the loss and every LoRA gradient of the
    plain FSDP2 model."""
    d = str(make_model(tmp_path / "model", "qwen2", hidden=64))
    plain = run_ranks(train_on_ranks, WORLD, d, False, True, "fp32", "", True)
    ran = run_ranks(train_on_ranks, WORLD, d, exchange, True, "fp32", "", True) if exchange else plain
    for p, r in zip(plain, ran):
        assert r["reduced"] == 1, r["reduced"]
        assert r["loss"] == pytest.approx(p["loss"], rel=1e-5)
        for name, grad in p["grads"].items():
            torch.testing.assert_close(r["grads"][name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_counts_recorded_for_a_forward_are_agreed_on_at_the_first_ask(monkeypatch):
    """Inside ``agreed_counts.forward`` the first part to ask agrees on both counts in one collective and the
    later parts read them; a part that counts more than was recorded stops, named, rather than cutting its
    tokens; outside, each ask is its own collective."""
    from shardtune.parallel import agreed_counts
    from shardtune.runtime import distributed

    asked = []  # every rank's largest: here, one more than this rank's
    monkeypatch.setattr(distributed, "all_reduce_max_each",
                        lambda values, device, group=None: asked.append(list(values)) or [v + 1 for v in values])
    group, cpu = object(), torch.device("cpu")
    with agreed_counts.forward(tokens=10, scored=4):
        assert agreed_counts.most("tokens", 10, cpu, group) == 11
        assert agreed_counts.most("scored", 4, cpu, group) == 5
        assert agreed_counts.most("tokens", 10, cpu, group) == 11
        with pytest.raises(RuntimeError, match="12 tokens on this rank, more than the 11 agreed on"):
            agreed_counts.most("tokens", 12, cpu, group)
    assert asked == [[10, 4]]
    assert agreed_counts.most("scored", 3, cpu, group) == 4 and asked[-1] == [3]


def test_a_forward_that_raised_leaves_no_pass_open():
    """A pass left open by a forward that raised would let a later recompute take a stale count for its own
    forward's (``_Pass``): its end runs however the model's forward ends."""
    from torch import nn

    from shardtune.parallel.exchanged_layers import _rounds

    class Failing(nn.Module):
        def forward(self, x):
            raise RuntimeError("out of memory")

    model = Failing()
    rounds, handles = _rounds(model, group=None)
    with pytest.raises(RuntimeError, match="out of memory"):
        model(torch.zeros(2))
    assert not rounds[model].pass_.running
    for h in handles:
        h.remove()
