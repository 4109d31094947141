"""GRPO's generation through FSDP2's row shards, never gathering a decoder layer (``exchanged_layers``).

Generating token by token, FSDP2 would gather every unit for every token's forward; kept gathered instead,
each rank holds the whole model beside its shard. Here each frozen ``nn.Linear`` (LoRA's base layers, the
projections LoRA leaves alone) computes from its own rows where they lie: every rank's inputs are
all-gathered, each rank multiplies them by its rows, and one all-to-all brings each rank its outputs
(parallel/exchange.py): moved per token, the inputs and outputs of the layer, a few KB, never its weights.
Each rank reads only its shard of the weights per token, 1/N of what a gathered model reads. The projections
that read the same tensor (q, k and v; gate and up) share one gather of their inputs and one all-to-all of
their outputs (``_Round``).
Everything else in the units, small beside the projections (LoRA's A and B, norms), is gathered once for
the generation and read through an instance attribute that shadows the sharded parameter
(runtime/compat ``shadow_parameter``), as FSDP's own unsharded views do; a 2-D frozen weight that is not an
``nn.Linear`` (GPT-2's ``Conv1D``) is gathered the same way: correct, without the saving. FSDP2's
forward hooks are paused meanwhile (``fsdp2_forward_hooks_paused``): no unit gathers or reshards.

Every forward inside is a collective, as in the lockstep generation (train/generation.py): all ranks run
each one. Each rank keeps its own rows, KV cache and sampling. The row-sharded embedding tables are
exchanged the same way by sharded_embeddings.exchanged. DoRA reads its base weight whole: not supported
here (the planner keeps such runs on the gathered paths).

In training too (``exchange_in_place``, ``RunPlan.layers_exchanged``: where a step's few tokens weigh less
than the layers FSDP2 would gather for them twice), the frozen projections leave FSDP for good: their rows
are sharded here as DTensors (loaded like any shard), and their forward is the exchange, whose backward
runs it in reverse for the inputs' gradient (parallel/exchange.py ``ExchangedLinear``). FSDP2's units then
hold only what trains and the small rest, gathered as before.

In training the token count the ranks pad to is agreed on once per forward of the whole model (``_Pass``: one
all-reduce, read on the host, where one per decoder layer would stall a GPU's queue once a layer; in a forward
the loss head scores, the same one as the row-sharded tables', agreed_counts.py), which every decoder layer of
that forward shares; a layer recomputed under activation checkpointing, after the model's
forward, pads as its own forward did. While generating every rank's forwards carry as many tokens, so none is
agreed on. The inputs a round gathered are let go when the layer's forward ends, or its backward begins (a
recompute stops early).

Where every rank of the group runs every rank's rows (``replicated``: a generation of few tokens, whose forwards
are all latency; ``RunPlan.generation_replicated``), each rank holds the inputs of every rank already: each
multiplies them by its rows and one all-gather hands every rank all the outputs (exchange.py
``replicated_linears``): per projection one collective instead of two. Every rank then holds the same outputs
of each projection, and the same logits (the head's are all-gathered too), so every rank samples the same tokens.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard

from shardtune.model.structure import decoder_layers
from shardtune.parallel import agreed_counts
from shardtune.parallel.exchange import ExchangedLinear, everyones, replicated_linears
from shardtune.parallel.sharded_embeddings import ShardedEmbedding, ShardedHead, row_counts, shard_rows
from shardtune.runtime import compat


class _Pass:
    """The token count agreed on for one forward of the whole model (module doc): learned at the first exchange
    that needs it, with one all-reduce, and shared by every decoder layer's round in that forward (the hidden
    states keep their token count from layer to layer). ``running``: between the model's forward hooks; outside
    them (a recompute in backward) each round keeps the count of its own forward."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.running = False
        self.tokens: int | None = None  # every rank's largest

    def start(self, *_: object) -> None:
        self.running, self.tokens = True, None

    def end(self, *_: object) -> None:
        self.running = False

    def agreed(self, local: int, device: torch.device) -> int:
        """The count every rank pads ``local`` tokens to: agreed on now (every rank together) unless this forward
        of the model has already."""
        if self.running and self.tokens is not None:
            return self.tokens
        tokens = agreed_counts.most("tokens", local, device, self.group)
        if self.running:
            self.tokens = tokens
        return tokens


class _Round:
    """What the exchanges of one decoder layer's forward share: the padded token count (every rank's largest,
    the model forward's ``_Pass``), the last inputs gathered, with the tensor they came from, and the outputs computed
    ahead for the projections that read the same inputs.

    The projections that read one tensor (q, k and v; gate and up) are learned in the first forward, where the
    later ones find their inputs gathered already; from then on the first one computes all of them and sends
    their outputs in one all-to-all, and the others take theirs when they are called with that tensor."""

    def __init__(self, group: dist.ProcessGroup, pass_: _Pass) -> None:
        self.group, self.pass_ = group, pass_
        self.tokens: int | None = None
        self.source: torch.Tensor | None = None
        self.version = -1
        self.everyone: torch.Tensor | None = None
        self.gatherer: _ExchangedForward | None = None  # whose call gathered ``everyone``
        self.followers: dict[_ExchangedForward, list[_ExchangedForward]] = {}
        self.ahead: dict[_ExchangedForward, torch.Tensor] = {}  # outputs computed ahead, for ``source``
        self.equal = False  # every rank's forward carries as many tokens (generation): no count to agree on
        self.replicated = False  # every rank's forward carries every rank's tokens: nothing to gather

    def reset(self, *_: object) -> None:
        if self.pass_.running:  # else a recompute in backward: padded as its own forward was
            self.tokens = None
        self.drop()

    def drop(self, *_: object) -> None:
        self.source, self.everyone, self.gatherer = None, None, None
        self.ahead.clear()

    def outputs(self, call: _ExchangedForward, x: torch.Tensor) -> torch.Tensor:
        """``call``'s outputs for ``x``: computed ahead, or now (with those of the calls that follow it)."""
        if self._holds(x):
            if call in self.ahead:
                return self.ahead.pop(call)
            # inputs another call gathered: this one follows it, from the next forward on
            followers = self.followers.setdefault(self.gatherer, [])
            if call is not self.gatherer and call not in followers:
                followers.append(call)
            calls = [call]
        else:
            calls = [call, *self.followers.get(call, [])]
            if self.replicated:
                self._hold(x, call)
            else:  # FSDP's mixed precision casts a unit's inputs to the weights' dtype; so here
                self._gather(x.detach().to(call.compute_dtype(x)), x, call)
        weights, biases, rows = zip(*(c.parts(x) for c in calls))
        if self.replicated:
            flat = x.detach().to(call.compute_dtype(x)).reshape(-1, x.size(-1))
            outs = [out.view(*x.shape[:-1], out.size(-1))
                    for out in replicated_linears(flat, list(weights), list(biases), list(rows), self.group)]
        else:
            outs = ExchangedLinear.apply(x, self.everyone, list(weights), list(biases), list(rows), self.group,
                                         self.drop)
        self.ahead.update(zip(calls[1:], outs[1:]))
        return outs[0]

    def _holds(self, x: torch.Tensor) -> bool:
        """Whether ``x`` is the tensor the inputs were gathered from, unchanged: the same object, or another view
        of the same memory (FSDP2 hands each unit's forward its own view of its inputs, in training)."""
        s = self.source
        return s is not None and (s is x or (s.data_ptr() == x.data_ptr() and s.shape == x.shape and
                                             s.stride() == x.stride() and s.dtype == x.dtype)) and \
            self.version == x._version

    def _gather(self, inputs: torch.Tensor, x: torch.Tensor, call: _ExchangedForward) -> None:
        flat = inputs.reshape(-1, inputs.size(-1))
        if self.tokens is None and self.equal:
            self.tokens = flat.size(0)
        elif self.tokens is None:
            self.tokens = self.pass_.agreed(flat.size(0), flat.device)
        if flat.size(0) > self.tokens:  # one count per forward: the ranks would disagree on the shape gathered
            raise RuntimeError(f"exchanged layers: a projection's inputs carry {flat.size(0)} tokens, more than the "
                               f"{self.tokens} every rank pads to in this forward of the model (agreed on at its "
                               "first exchange, or kept from the forward a recompute repeats)")
        self.everyone = everyones(flat, 0.0, self.group, shape=[self.tokens, flat.size(1)])
        self._hold(x, call)

    def _hold(self, x: torch.Tensor, call: _ExchangedForward) -> None:
        """``x`` as the tensor whose outputs are computed (``call``'s, and those computed ahead). Held: its memory
        cannot become another tensor's meanwhile."""
        self.ahead.clear()
        self.source, self.version, self.gatherer = x, x._version, call


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

    def compute_dtype(self, x: torch.Tensor) -> torch.dtype:
        """The dtype this projection computes in for inputs ``x``: FSDP2's ``param_dtype`` for a plain weight;
        a 4-bit one (a tensor subclass, which F.linear dequantizes itself) computes in the inputs'."""
        return self.dtype if type(compat.dtensor_local(self.module.weight)) is torch.Tensor else x.dtype

    def parts(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, list[int]]:
        """This rank's rows of the weight and bias, in the dtype they compute in, and the rows per rank."""
        weight, dtype = compat.dtensor_local(self.module.weight), self.compute_dtype(x)
        if type(weight) is torch.Tensor:
            weight = weight.to(dtype)
        bias = None if self.module.bias is None else compat.dtensor_local(self.module.bias).to(dtype)
        return weight, bias, self.rows

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.round.outputs(self, x)


def _row_sharded(p: torch.Tensor | None) -> bool:
    return isinstance(p, DTensor) and not p.requires_grad and \
        [pl for pl in p.placements if not pl.is_replicate()] == [Shard(0)]


def _exchangeable(module: nn.Module) -> bool:
    return type(module) is nn.Linear and _row_sharded(module.weight) and module.weight.ndim == 2 and \
        (module.bias is None or _row_sharded(module.bias))


def _exchanged(module: nn.Module) -> bool:
    return isinstance(module.__dict__.get("forward"), _ExchangedForward)


def _rounds(model: nn.Module, group: dist.ProcessGroup) -> tuple[dict[nn.Module, _Round], list]:
    """A ``_Round`` for each decoder layer's modules (one for the rest of the model), started by the layer's
    forward and let go at its end, all sharing the ``_Pass`` of the model's forward; returns {module: its
    round} and the hooks' handles."""
    rounds: dict[nn.Module, _Round] = {}
    pass_ = _Pass(group)
    # first: the model's own round starts within its pass; ended even by a forward that raised
    handles = [model.register_forward_pre_hook(pass_.start),
               model.register_forward_hook(pass_.end, always_call=True)]
    for owner in [*decoder_layers(model), model]:
        round_ = _Round(group, pass_)
        handles += [owner.register_forward_pre_hook(round_.reset), owner.register_forward_hook(round_.drop)]
        for module in owner.modules():
            rounds.setdefault(module, round_)
    return rounds, handles


def exchange_in_place(model: nn.Module, mesh: DeviceMesh, dtype: torch.dtype) -> set[nn.Parameter]:
    """Every frozen ``nn.Linear`` of ``model``'s decoder layers (4-bit ones too) computed from its row shards
    from now on, in training and generation (module doc); called on the meta model before FSDP2 shards it.
    ``mesh``: the 1-D shard group's. Returns the row-sharded parameters, which FSDP2 must leave alone."""
    group = mesh.get_group()
    rounds, _ = _rounds(model, group)  # the hooks stay for the model's life
    outside: set[nn.Parameter] = set()
    for layer in decoder_layers(model):
        for module in layer.modules():
            if type(module) is not nn.Linear or any(p.requires_grad for p in module.parameters(recurse=False)):
                continue
            for name in ("weight", "bias"):
                if getattr(module, name) is not None:
                    setattr(module, name, shard_rows(getattr(module, name), mesh))
                    outside.add(getattr(module, name))
            module.__dict__["forward"] = _ExchangedForward(module, rounds[module], dtype)
    return outside


@contextlib.contextmanager
def exchanged_layers(model: nn.Module, group: dist.ProcessGroup, dtype: torch.dtype,
                     replicated: bool = False) -> Iterator[None]:
    """``model``'s FSDP2 units computed from their row shards until the block ends (module doc); ``group``:
    the ranks that hold one copy of the model between them; ``dtype``: the compute dtype (FSDP2's
    ``param_dtype``). Every forward inside must carry as many tokens on every rank (generation pads every rank's
    prompts alike): no token count is agreed on per layer, for the projections exchanged for good
    (``exchange_in_place``) either until the block ends. ``replicated``: every forward inside carries the same
    tokens on every rank of ``group`` (each runs all of the group's rows), so each projection's outputs are
    all-gathered and no input moves. Every unit is sharded on entry and left sharded, its hooks back, even on an
    error."""
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    shadowed: list[tuple[nn.Module, str]] = []
    with contextlib.ExitStack() as stack:
        for unit in units:
            unit.reshard()
            stack.enter_context(compat.fsdp2_forward_hooks_paused(unit))
        rounds, handles = _rounds(model, group)
        for handle in handles:
            stack.callback(handle.remove)
        for round_ in {*rounds.values(), *(m.forward.round for m in model.modules() if _exchanged(m))}:
            # the block's own rounds go with it; those for good are set back
            round_.equal, round_.replicated = True, replicated
            stack.callback(setattr, round_, "equal", False)
            stack.callback(setattr, round_, "replicated", False)
        stack.callback(_unshadow, shadowed)
        for module in model.modules():
            if isinstance(module, (ShardedEmbedding, ShardedHead)) or _exchanged(module):
                continue  # exchanged on their own (sharded_embeddings.exchanged), or for good
            if _exchangeable(module):
                module.__dict__["forward"] = _ExchangedForward(module, rounds[module], dtype)
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
