"""shardtune.load_sharded in a user's own loop: the same model, LoRA init and gradients as from_pretrained + peft."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dist_utils import run_ranks
from tiny import make_model

INPUT = torch.arange(1, 31).reshape(2, 15) * 13 % 250
LORA = {"r": 4, "alpha": 8, "targets": "q_proj,v_proj,down_proj"}
ROOT = Path(__file__).resolve().parents[1]


def sharded_rank(rank: int, world_size: int, model_dir: str, with_meta: bool) -> dict:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    import shardtune

    meta = None
    if with_meta:
        from accelerate import init_empty_weights
        from transformers import AutoConfig, AutoModelForCausalLM

        with init_empty_weights(include_buffers=False):
            meta = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=torch.float32)
        meta.tie_weights()
    model = shardtune.load_sharded(model_dir, LORA, meta_model=meta, dtype="fp32", seed=3)
    logits = model(input_ids=INPUT).logits
    logits.float().pow(2).mean().backward()
    grads = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
             for n, p in model.named_parameters() if p.requires_grad}
    fsdp = type(model).__name__.startswith("FSDP")
    dist.destroy_process_group()
    return {"logits": logits.detach(), "grads": grads, "fsdp": fsdp}


def _reference(model_dir: Path) -> tuple[torch.Tensor, dict]:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(3)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
    logits = model(input_ids=INPUT).logits
    logits.pow(2).mean().backward()
    return logits.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("with_meta", [False, True])
def test_two_ranks_match_from_pretrained(tmp_path: Path, with_meta: bool) -> None:
    model_dir = make_model(tmp_path / "model", "llama", tied=True)
    ranks = run_ranks(sharded_rank, 2, str(model_dir), with_meta)
    logits, grads = _reference(model_dir)
    assert ranks[0]["fsdp"] and set(ranks[0]["grads"]) == set(grads)
    for r in ranks:
        torch.testing.assert_close(r["logits"], logits, rtol=1e-4, atol=1e-5)
        for name, g in grads.items():
            # lora_B's gradient depends on lora_A: equal gradients mean equal initial values
            torch.testing.assert_close(r["grads"][name], g, rtol=1e-4, atol=1e-6, msg=name)


def test_unknown_lora_option_is_named(tmp_path: Path) -> None:
    import shardtune
    from shardtune.config import ConfigError

    with pytest.raises(ConfigError, match="unknown LoRA option.*rank"):
        shardtune.load_sharded(tmp_path, {"rank": 4})
    assert "every rank must call" in shardtune.load_sharded.__doc__.lower().replace("\n    ", " ") or \
        "Every rank must call" in shardtune.load_sharded.__doc__


def test_example_own_loop_runs_on_two_ranks(tmp_path: Path) -> None:
    model_dir = make_model(tmp_path / "model", "llama")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(ROOT / "examples" / "own_loop.py"), "--model", str(model_dir), "--data",
         str(ROOT / "examples" / "tiny_text.jsonl"), "--steps", "3"],
        env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "step 3: loss" in run.stdout


class _GroupMade(Exception):
    pass


def _pretend_cuda(monkeypatch) -> list[str]:
    """This process on a GPU as far as init_worker can tell; the process group it asks for is recorded
    (there is no NCCL here to make it)."""
    import torch.distributed as dist

    from shardtune.runtime import distributed

    asked: list[str] = []

    def init_process_group(backend=None, **kwargs):
        asked.append(backend)
        raise _GroupMade

    monkeypatch.setattr(distributed, "device_type", lambda requested="auto": "cuda")
    monkeypatch.setattr(distributed, "local_device", lambda kind, rank=0, ranks=1: torch.device("cuda", rank))
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    return asked


def test_cpu_offload_on_cuda_gets_a_group_with_gloo_for_its_cpu_tensors(tmp_path: Path, monkeypatch) -> None:
    """Offloaded shards and gradients are CPU tensors (clipping all-reduces their norm): an NCCL-only group
    failed there, deep in the first step."""
    import torch.distributed as dist

    import shardtune
    from shardtune.config import ConfigError

    model_dir = make_model(tmp_path / "model", "llama")
    asked = _pretend_cuda(monkeypatch)
    with pytest.raises(_GroupMade):
        shardtune.load_sharded(model_dir, LORA, cpu_offload=True)
    with pytest.raises(_GroupMade):
        shardtune.load_sharded(model_dir, LORA)
    assert asked == ["cuda:nccl,cpu:gloo", "nccl"]
    # A group the caller made with NCCL alone is named before anything is loaded.
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: "cuda:nccl")
    with pytest.raises(ConfigError, match=r"CPU offload on CUDA needs .*'cuda:nccl'.*backend='cuda:nccl,cpu:gloo'"):
        shardtune.load_sharded(model_dir, LORA, cpu_offload=True)
