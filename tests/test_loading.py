"""Shard-only loading gives the model from_pretrained gives, on 2 ranks, for several layouts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dist_utils import finetune_on_ranks, run_ranks
from tiny import instruction_records, make_model, write_jsonl

INPUT = torch.arange(1, 25).reshape(2, 12) * 7 % 250

LAYOUTS = [  # (architecture, tied embeddings, sharded checkpoint files)
    ("llama", True, False),
    ("llama", False, True),
    ("qwen2", True, True),
    ("qwen2", False, False),
    ("gpt2", True, False),
]


def load_on_ranks(rank: int, world_size: int, model_dirs: list[str], strategy: str) -> dict:
    from shardtune.config import build_config
    from shardtune.parallel.sharded_model import build_model
    from shardtune.runtime import distributed
    from shardtune.train.resolve import resolve_on

    worker = distributed.init_worker()
    results = {}
    for d in model_dirs:
        cfg = build_config({"model": d, "dtype": "fp32", "strategy": strategy, "seed": 3})
        built = build_model(cfg, worker, resolve_on(worker, cfg, batches=False))
        # before forward: FSDP2 keeps the root unit gathered after it (reshard_after_forward=False)
        local_numel = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel()
                          for p in built.model.parameters())
        built.model.eval()
        with torch.no_grad():
            logits = built.model(input_ids=INPUT).logits
        lora = built.strategy.full_tensors(built.model, [n for n in built.adapter_keys.values() if "lora_" in n])
        results[d] = {"logits": logits, "local_numel": local_numel, "total": built.total_params, "lora": lora}
    distributed.teardown()
    return results


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> list[str]:
    root = tmp_path_factory.mktemp("models")
    return [str(make_model(root / f"{a}-{'tied' if t else 'untied'}-{'sharded' if s else 'single'}", a, t, s))
            for a, t, s in LAYOUTS]


def _reference(d: str) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        return AutoModelForCausalLM.from_pretrained(d).eval()(input_ids=INPUT).logits


def test_fsdp2_two_ranks_match_from_pretrained(model_dirs):
    results = run_ranks(load_on_ranks, 2, model_dirs, "fsdp2")
    for d in model_dirs:
        if "sharded" in d:
            assert (Path(d) / "model.safetensors.index.json").is_file()
        expected = _reference(d)
        for rank in range(2):
            torch.testing.assert_close(results[rank][d]["logits"], expected, rtol=1e-5, atol=1e-5, msg=d)
        # Sharded, not replicated: every element of the model is held by exactly one rank, and each
        # rank holds about half (shards round up to whole rows).
        total, held = results[0][d]["total"], [results[r][d]["local_numel"] for r in range(2)]
        assert sum(held) == total and max(held) < 0.55 * total, (d, held, total)


def test_lora_init_equals_peft_for_same_seed(model_dirs):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    d = model_dirs[0]
    results = run_ranks(load_on_ranks, 2, [d], "fsdp2")
    torch.manual_seed(3)
    ref = get_peft_model(AutoModelForCausalLM.from_pretrained(d),
                         LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM"))
    expected = {n: p.detach() for n, p in ref.named_parameters() if "lora_A" in n}
    assert expected
    for rank in range(2):
        got = results[rank][d]["lora"]
        for name, value in expected.items():
            torch.testing.assert_close(got[name], value, rtol=0, atol=0, msg=name)


def test_tied_weight_stored_under_lm_head_name(tmp_path):
    """Some tools write a tied embedding only as lm_head.weight; loading must still find it."""
    from safetensors.torch import load_file, save_file

    d = make_model(tmp_path / "m", "llama", tied=True)
    tensors = load_file(d / "model.safetensors")
    tensors["lm_head.weight"] = tensors.pop("model.embed_tokens.weight")
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    assert json.loads((d / "config.json").read_text())["tie_word_embeddings"]
    results = run_ranks(load_on_ranks, 2, [str(d)], "fsdp2")
    torch.testing.assert_close(results[0][str(d)]["logits"], _reference(str(d)), rtol=1e-5, atol=1e-5)


def test_tied_lm_head_in_modules_to_save_trains_alike_on_every_strategy(tmp_path):
    """peft's trainable copy of a tied lm_head starts from the embedding (the checkpoint stores only
    that name) and ends equal on every strategy. On ranks started as plain torchrun starts them."""
    from safetensors.torch import load_file

    model = make_model(tmp_path / "model", "llama", tied=True)
    data = write_jsonl(tmp_path / "train.jsonl", instruction_records(8))
    adapters = {}
    for strategy, nproc in (("single", 1), ("ddp", 2), ("fsdp1", 2), ("fsdp2", 2)):
        out = tmp_path / strategy
        finetune_on_ranks({"model": str(model), "data": str(data), "out": str(out), "dtype": "fp32", "steps": 2,
                           "batch-size": 4, "lr": 1e-2, "lora-modules-to-save": "lm_head", "strategy": strategy},
                          nproc)
        adapters[strategy] = load_file(out / "adapter" / "adapter_model.safetensors")
    head = "base_model.model.lm_head.weight"
    embed = load_file(model / "model.safetensors")["model.embed_tokens.weight"]
    assert (adapters["single"][head] - embed).abs().max() > 1e-4  # trained away from its start
    for strategy, tensors in adapters.items():
        assert set(tensors) == set(adapters["single"]), strategy
        for key in tensors:
            torch.testing.assert_close(tensors[key], adapters["single"][key], rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_finiteness_check_finds_nan_and_both_infinities_anywhere(dtype):
    from shardtune.model.finite import all_finite

    for bad in (float("nan"), float("inf"), -float("inf")):
        for where in (0, 37, -1):
            t = torch.randn(8, 16).to(dtype)
            t.view(-1)[where] = bad
            assert not all_finite(t), (bad, where)
    assert not all_finite(torch.full((4,), float("nan"), dtype=dtype))
    assert all_finite(torch.randn(8, 16).to(dtype)) and all_finite(torch.tensor([65504.0, -65504.0]).to(dtype))
    assert all_finite(torch.arange(4)) and all_finite(torch.empty(0, dtype=dtype))  # no float values: none to fault
