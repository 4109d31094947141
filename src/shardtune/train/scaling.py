"""fp16 loss scaling, for GPUs without bf16 (T4, V100): torch's ``ShardedGradScaler``.

fp16 has bf16's precision but not its range: small activation gradients underflow to zero. The
loss is multiplied by a scale before backward and the gradients divided by it before clipping and
the step; a step whose gradients hold inf/NaN on any rank is skipped on every rank and the scale
halved. The sharded scaler (unlike ``torch.amp.GradScaler``) handles gradients that are shards
(FSDP2's DTensors, FSDP1's flat parameters) and CPU gradients (``--cpu-offload``), and agrees on
"found inf" over the process group. With bf16/fp32 it is disabled: every call passes through.
"""

from __future__ import annotations

import torch
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler


def make_scaler(dtype: str, device: torch.device) -> ShardedGradScaler:
    """The run's scaler: enabled for ``--dtype fp16`` only."""
    return ShardedGradScaler(device=device.type, enabled=dtype == "fp16")
