"""GRPO's generation through FSDP2's row shards, never gathering a decoder layer (``exchanged_layers``).

Generating token by token, FSDP2 would gather every unit for every token's forward; kept gathered instead,
each rank holds the whole model beside its shard. Here each frozen ``nn.Linear`` (LoRA's base layers, the
projections LoRA leaves alone) computes from its own rows where they lie: every rank's inputs are
all-gathered, each rank multiplies them by its rows, and one all-to-all brings each rank its outputs
(parallel/exchange.py): moved per token, the inputs and outputs of the layer, a few KB, never its weights.
Each rank reads only its shard of the weights per token, 1/N of what a gathered model reads. The inputs
gathered for one projection serve the next when they are the same tensor (q, k and v; gate and up).
Everything else in the units, small beside the projections (LoRA's A and B, norms), is gathered once for
the generation and read through an instance attribute that shadows the sharded parameter
(runtime/compat ``shadow_parameter``), as FSDP's own unsharded views do; a 2-D frozen weight that is not an
``nn.Linear`` (GPT-2's ``Conv1D``) is gathered the same way: correct, without the saving. FSDP2's
forward hooks are paused meanwhile (``fsdp2_forward_hooks_paused``): no unit gathers or reshards.

Every forward inside is a collective, as in the lockstep generation (train/generation.py): all ranks run
each one. Each rank keeps its own rows, KV cache and sampling. The row-sharded embedding tables are
exchanged the same way by sharded_embeddings.exchanged. DoRA reads its base weight whole: not supported
here (the planner keeps such runs on the gathered paths).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard

from shardtune.parallel.exchange import everyones, exchanged_linear
from shardtune.parallel.sharded_embeddings import ShardedEmbedding, ShardedHead, row_counts
from shardtune.runtime import compat


class _Round:
    """What the exchanges of one forward share: the padded token count (every rank's largest, found once
    per forward) and the last inputs gathered, with the tensor they came from."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.tokens: int | None = None
        self.source: torch.Tensor | None = None
        self.version = -1
        self.everyone: torch.Tensor | None = None

    def reset(self, *_: object) -> None:
        self.tokens, self.source, self.everyone = None, None, None

    def gathered(self, x: torch.Tensor) -> torch.Tensor:
        if self.source is x and self.version == x._version:
            return self.everyone
        flat = x.reshape(-1, x.size(-1))
        if self.tokens is None:
            count = torch.tensor([flat.size(0)], device=flat.device)
            dist.all_reduce(count, op=dist.ReduceOp.MAX, group=self.group)
            self.tokens = int(count.item())
        self.everyone = everyones(flat, 0.0, self.group, shape=[self.tokens, flat.size(1)])
        self.source, self.version = x, x._version  # held: its memory cannot become another tensor's meanwhile
        return self.everyone


class _ExchangedForward:
    """The forward of a frozen ``nn.Linear`` with row-sharded weight (and bias) while exchanged."""

    def __init__(self, module: nn.Linear, round_: _Round, dtype: torch.dtype) -> None:
        self.module, self.round, self.dtype = module, round_, dtype
        self.rows = row_counts(module.out_features, round_.group.size())
        local = compat.dtensor_local(module.weight)
        if local.size(0) != self.rows[round_.group.rank()]:
            raise compat.PrivateAPIChanged(
                "FSDP2's row shards", f"rank {round_.group.rank()} holds {local.size(0)} rows of "
                f"{module.out_features}, not torch.chunk's {self.rows[round_.group.rank()]}")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        weight = compat.dtensor_local(self.module.weight)
        if weight.dtype != self.dtype and weight.is_floating_point() and type(weight) is torch.Tensor:
            weight = weight.to(self.dtype)
        bias = None if self.module.bias is None else compat.dtensor_local(self.module.bias).to(x.dtype)
        out = exchanged_linear(self.round.gathered(x), x.numel() // x.size(-1), weight, bias, self.rows,
                               self.round.group)
        return out.view(*x.shape[:-1], self.module.out_features)


def _row_sharded(p: torch.Tensor | None) -> bool:
    return isinstance(p, DTensor) and not p.requires_grad and \
        [pl for pl in p.placements if not pl.is_replicate()] == [Shard(0)]


def _exchangeable(module: nn.Module) -> bool:
    return type(module) is nn.Linear and _row_sharded(module.weight) and module.weight.ndim == 2 and \
        (module.bias is None or _row_sharded(module.bias))


@contextlib.contextmanager
def exchanged_layers(model: nn.Module, group: dist.ProcessGroup, dtype: torch.dtype) -> Iterator[None]:
    """``model``'s FSDP2 units computed from their row shards until the block ends (module doc); ``group``:
    the ranks that hold one copy of the model between them; ``dtype``: the compute dtype (FSDP2's
    ``param_dtype``). Every unit is sharded on entry and left sharded, its hooks back, even on an error."""
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    round_ = _Round(group)
    shadowed: list[tuple[nn.Module, str]] = []
    with contextlib.ExitStack() as stack:
        for unit in units:
            unit.reshard()
            stack.enter_context(compat.fsdp2_forward_hooks_paused(unit))
        handle = model.register_forward_pre_hook(round_.reset)
        stack.callback(handle.remove)
        stack.callback(round_.reset)
        stack.callback(_unshadow, shadowed)
        for module in model.modules():
            if isinstance(module, (ShardedEmbedding, ShardedHead)):
                continue  # exchanged on their own (sharded_embeddings.exchanged)
            if _exchangeable(module):
                module.__dict__["forward"] = _ExchangedForward(module, round_, dtype)
                shadowed.append((module, "forward"))
                continue
            for name, p in module.named_parameters(recurse=False):
                if isinstance(p, DTensor):
                    full = p.detach().full_tensor()
                    compat.shadow_parameter(module, name, dtype if full.is_floating_point() else full.dtype,
                                            value=full)
                    shadowed.append((module, name))
        yield


def _unshadow(shadowed: list[tuple[nn.Module, str]]) -> None:
    for module, name in shadowed:
        module.__dict__.pop(name, None)
