"""FSDP2's units: which decoder layers stay gathered between forward and backward."""

from __future__ import annotations

import pytest
import torch

from dist_utils import run_ranks
from tiny import make_model


def gathered_after_forward_and_backward(rank: int, world_size: int, model_dir: str, unit: str) -> dict:
    from torch.distributed.tensor import DTensor

    from shardtune.config import build_config
    from shardtune.model.structure import decoder_layers
    from shardtune.parallel.sharded_model import build_model
    from shardtune.runtime import distributed
    from shardtune.train.resolve import resolve_on

    worker = distributed.init_worker()
    cfg = build_config({"model": model_dir, "dtype": "fp32", "strategy": "fsdp2", "fsdp-unit": unit, "seed": 3})
    model = build_model(cfg, worker, resolve_on(worker, cfg, batches=False)).model.train()
    layers = decoder_layers(model)

    def gathered() -> list[bool]:  # a resharded unit registers its DTensor shards, a gathered one plain tensors
        return [not isinstance(layer.self_attn.q_proj.base_layer.weight, DTensor) for layer in layers]

    ids = torch.arange(16).reshape(1, 16) + rank
    loss = model(input_ids=ids, labels=ids).loss
    after_forward = gathered()
    loss.backward()
    out = {"after_forward": after_forward, "after_backward": gathered()}
    distributed.teardown()
    return out


@pytest.mark.parametrize("unit", ["layer", "part"])
def test_only_the_last_whole_layer_unit_stays_gathered_into_backward(tmp_path, unit):
    """Backward starts with the last layer, right after forward: whole-layer units keep it gathered instead
    of gathering it again at once; every other unit (and every per-part unit, chosen to fit) is resharded
    after its forward, and all are resharded after backward."""
    model_dir = str(make_model(tmp_path / "model", "llama"))
    for r in run_ranks(gathered_after_forward_and_backward, 2, model_dir, unit):
        assert r["after_forward"] == ([False, True] if unit == "layer" else [False, False])
        assert r["after_backward"] == [False, False]


def gradients_three_ways(rank: int, world_size: int, model_dir: str) -> dict:
    from shardtune.config import build_config
    from shardtune.model.structure import decoder_layers
    from shardtune.parallel.sharded_model import build_model
    from shardtune.runtime import distributed
    from shardtune.train.resolve import resolve_on

    worker = distributed.init_worker()
    cfg = build_config({"model": model_dir, "dtype": "fp32", "strategy": "fsdp2", "fsdp-unit": "layer", "seed": 3,
                        "lora-targets": "all-linear"})
    built = build_model(cfg, worker, resolve_on(worker, cfg, batches=False))
    model, strategy = built.model.train(), built.strategy
    params = strategy.trainable(model)
    ids = torch.arange(16).reshape(1, 16) * (rank + 1) % 200

    def grads() -> dict[str, torch.Tensor]:
        return {n: p.grad.full_tensor().clone() for n, p in params.items()}

    model(input_ids=ids, labels=ids).loss.backward()  # a user's own loop: no gradient_sync around it
    immediate = grads()
    for p in params.values():
        p.grad = None
    with strategy.gradient_sync(model, enabled=True):
        model(input_ids=ids, labels=ids).loss.backward()
        pending = len(strategy.reduce.pending)
    deferred = grads()
    with strategy.gradient_sync(model, enabled=True):  # gradients are there: FSDP2 adds to them
        model(input_ids=ids, labels=ids).loss.backward()
        pending_adding = len(strategy.reduce.pending)
    added = grads()
    distributed.teardown()
    return {"immediate": immediate, "deferred": deferred, "added": added, "pending": pending,
            "pending_adding": pending_adding, "layers": len(decoder_layers(model))}


def test_gloo_reduce_scatters_finish_at_the_step_end_with_the_same_gradients(tmp_path):
    """On the CPU the reducing backward starts every layer's reduce-scatter without waiting for it (the
    ranks then meet only at the prefetched gathers) and waits for all once backward is over: the
    gradients are FSDP2's own, also when a second backward adds to them (then nothing is deferred)."""
    model_dir = str(make_model(tmp_path / "model", "llama"))
    for r in run_ranks(gradients_three_ways, 2, model_dir):
        assert r["pending"] == r["layers"] and r["pending_adding"] == 0  # one reduce per layer unit
        for name, g in r["immediate"].items():
            assert "lora_A" in name or g.abs().sum() > 0, name  # B starts at zero: only A's gradient is 0
            torch.testing.assert_close(r["deferred"][name], g, rtol=1e-6, atol=1e-8, msg=name)
            torch.testing.assert_close(r["added"][name], 2 * g, rtol=1e-6, atol=1e-8, msg=name)
