"""Writing results to disk: the adapter in peft's format, atomically.

Only LoRA (trainable) tensors are ever gathered to full size; the frozen base never is.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from shardtune.parallel import Strategy


def replace_dir(tmp: Path, final: Path) -> None:
    """Put a fully written ``tmp`` at ``final``; a reader sees the old or the new one, never half."""
    old = final.with_name(f".{final.name}.old")
    if old.exists():
        shutil.rmtree(old)
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def save_adapter(
    model: nn.Module, strategy: Strategy, names: list[str], out: Path, base_model_path: str
) -> Path:
    """Write ``out`` (adapter_config.json + adapter_model.safetensors) on rank 0; a collective."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    full = strategy.full_tensors(model, names)
    if strategy.dist.is_main:
        peft_model = strategy.unwrap(model)
        state = get_peft_model_state_dict(peft_model, state_dict=full, save_embedding_layers=False)
        tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        save_file({k: v.contiguous() for k, v in state.items()}, str(tmp / "adapter_model.safetensors"),
                  metadata={"format": "pt"})
        config = peft_model.peft_config["default"]
        config.base_model_name_or_path = str(Path(base_model_path).resolve())
        config.save_pretrained(str(tmp))
        replace_dir(tmp, out)
    dist.barrier()
    return out


def adapter_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())


def to_cpu_fp32(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu", torch.float32) for k, v in tensors.items()}
