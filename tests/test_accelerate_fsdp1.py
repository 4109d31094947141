"""The FSDP1 wrap policy inside accelerate's FSDP plugin (accelerate ignores the plugin on CPU: GPU only)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dist_utils import run_ranks
from tiny import make_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="accelerate enables its FSDP plugin only on GPU-like devices (ignored on CPU)"),
]


def accelerate_rank(rank: int, world_size: int, model_dir: str) -> dict:
    from accelerate import Accelerator, FullyShardedDataParallelPlugin
    from peft import LoraConfig, get_peft_model
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from transformers import AutoModelForCausalLM

    from shardtune.parallel.wrap_policy import uniform_requires_grad_policy

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir),
                           LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    plugin = FullyShardedDataParallelPlugin(fsdp_version=1, auto_wrap_policy=uniform_requires_grad_policy(model),
                                            use_orig_params=False)
    accelerator = Accelerator(fsdp_plugin=plugin)
    model = accelerator.prepare(model)
    optimizer = accelerator.prepare(torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2))
    units = [m for m in model.modules() if isinstance(m, FSDP)]
    # FSDP1 refuses to flatten mixed requires_grad; the policy must give LoRA units of their own.
    flat_kinds = [unit._handle.flat_param.requires_grad for unit in units if unit._handle is not None]
    ids = (torch.arange(32).reshape(2, 16) * 7 % 250).to(accelerator.device)
    losses = []
    for _ in range(4):
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    result = {"type": accelerator.distributed_type.value, "root_fsdp": isinstance(model, FSDP),
              "units": len(units), "flat_kinds": flat_kinds, "losses": losses}
    accelerator.end_training()
    return result


def test_accelerate_fsdp1_plugin_wraps_a_peft_model_with_the_policy(tmp_path: Path) -> None:
    model_dir = make_model(tmp_path / "model", "llama")
    world = min(2, torch.cuda.device_count())
    for result in run_ranks(accelerate_rank, world, str(model_dir)):
        assert result["type"] == "FSDP" and result["root_fsdp"]
        # a unit per decoder layer plus the trainable LoRA subtrees: far more than the root alone
        assert result["units"] > 4
        assert True in result["flat_kinds"] and False in result["flat_kinds"]
        assert result["losses"][-1] < result["losses"][0]
