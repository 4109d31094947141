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

    worker = distributed.init_worker()
    cfg = build_config({"model": model_dir, "dtype": "fp32", "strategy": "fsdp2", "fsdp-unit": unit, "seed": 3})
    model = build_model(cfg, worker).model.train()
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
