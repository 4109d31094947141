"""FSDP1 strategy and its auto-wrap policy: uniform units, shard-only loading, gradients, on 2 ranks.

The distributed checks run once, in one spawned 2-rank job (``fsdp1_results``), and each test reads
its part: starting processes costs more than all of the tiny models together.
"""

from __future__ import annotations

import copy
import functools
import math
import re
from pathlib import Path

import pytest
import torch
from torch import nn

from shardtune.config import ConfigError, LoraConfig
from shardtune.model.directory import check_model_dir
from shardtune.model.lora import count_params, inject_lora
from shardtune.model.meta import build_meta_model
from shardtune.model.structure import layer_classes
from shardtune.parallel.fsdp1 import FSDP1, boxes
from shardtune.parallel.wrap_policy import NonUniformModuleError, uniform_requires_grad_policy, wrap_units
from shardtune.runtime.distributed import Worker

from dist_utils import run_ranks
from tiny import VOCAB, make_model

# (architecture, tied embeddings, LoRA options): LoRA on every linear layer everywhere, and a trained
# copy of an untied lm_head (peft's modules_to_save) on Llama.
CASES = {
    "llama-save-lm_head": ("llama", False, {"modules_to_save": "lm_head"}),
    "gpt2": ("gpt2", True, {}),
    "falcon": ("falcon", True, {}),
}
POLICY_CASES = {"llama": ("llama", False, {}), **CASES}
WORLD = 2


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    return {arch: make_model(tmp_path_factory.mktemp(arch), arch, tied) for arch, tied, _ in CASES.values()}


def meta_lora(path: Path, options: dict, dtype: torch.dtype = torch.float32):
    model = build_meta_model(check_model_dir(path), dtype)
    model, init = inject_lora(model, LoraConfig(**options), seed=0)
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()  # as build.py does
    return model, init


def unit_params(model: nn.Module, units: dict[str, nn.Module]) -> dict[str, list[nn.Parameter]]:
    """What each unit's flat parameter would hold: params owned by modules whose nearest unit it is."""
    out: dict[str, list[nn.Parameter]] = {u: [] for u in units}
    for name, module in model.named_modules():
        owner = max((u for u in units if u == "" or name == u or name.startswith(u + ".")), key=len)
        out[owner].extend(module.parameters(recurse=False))
    return out


# --- the policy alone, on meta models: no processes -------------------------------------------------


@pytest.mark.parametrize("case", POLICY_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_unit_is_uniform(model_dirs, case, dtype):
    arch, _, options = POLICY_CASES[case]
    model, _ = meta_lora(model_dirs[arch], options, dtype)
    units = wrap_units(model)
    for name, params in unit_params(model, units).items():
        assert len({(p.requires_grad, p.dtype) for p in params}) <= 1, name
    layers = [n for n, m in units.items() if type(m) in layer_classes(model)]
    assert len(layers) == 2  # frozen weights gathered a layer at a time
    trainable_units = [n for n, ps in unit_params(model, units).items() if ps and ps[0].requires_grad]
    # peft calls the Linear inside lora_A, never the ModuleDict: that Linear must be the unit
    assert all(n.endswith((".default", "lm_head.modules_to_save.default")) for n in trainable_units)


@pytest.mark.parametrize("arch, bias, module", [
    ("gpt2", "all", r"h\.0\.ln_1 \(LayerNorm\)"),
    ("gpt2", "lora_only", r"h\.0\.attn\.c_attn\.base_layer \(Conv1D\)"),
    ("falcon", "all", r"h\.0\.input_layernorm \(LayerNorm\)"),
    ("falcon", "lora_only", None),  # Falcon's Linears have no bias: nothing trains beside a frozen weight
])
def test_trainable_bias_on_frozen_weight_is_a_clear_error(model_dirs, arch, bias, module):
    """peft trains the bias of a module whose weight stays frozen: no FSDP1 unit can hold both."""
    model, _ = meta_lora(model_dirs[arch], {"bias": bias})
    if module is None:
        assert not [n for n, p in model.named_parameters() if p.requires_grad and n.endswith("bias")]
        for name, params in unit_params(model, wrap_units(model)).items():
            assert len({(p.requires_grad, p.dtype) for p in params}) <= 1, name
        return
    with pytest.raises(NonUniformModuleError, match=module + r": frozen .*\['weight'\], trainable .*\['bias'\]"):
        wrap_units(model)
    cpu = Worker(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    with pytest.raises(ConfigError, match="--lora-bias none, or --strategy fsdp2"):
        FSDP1(cpu, torch.float32, cpu_offload=False).shard(model)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)
        self.adapter = nn.Sequential(nn.Linear(4, 2, bias=False), nn.Linear(2, 4, bias=False))
        self.scales = nn.ParameterDict({"a": nn.Parameter(torch.ones(4))})


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(4, 10)


def test_any_tree_without_names():
    net = Net()
    net.requires_grad_(False)
    for block in net.blocks:
        block.norm.requires_grad_(True)
        block.adapter.requires_grad_(True)
    units = wrap_units(net)
    assert {type(net.blocks[0])} == {type(units[f"blocks.{i}"]) for i in range(3)}  # found as repeated blocks
    assert "blocks.0.norm" in units and "blocks.0.adapter" in units  # one unit for the whole adapter
    for name, params in unit_params(net, units).items():
        assert len({p.requires_grad for p in params}) <= 1, name

    net.blocks[1].proj.bias.requires_grad_(True)
    with pytest.raises(NonUniformModuleError, match=re.escape("blocks.1.proj (Linear)")):
        wrap_units(net)


def test_container_parameters_belong_to_the_module_that_runs():
    net = Net()
    net.requires_grad_(False)
    net.blocks[0].scales.requires_grad_(True)  # a ParameterDict is never called: its Block is the unit
    units = wrap_units(net, layer_classes=[])
    assert "blocks.0" in units and "blocks.0.scales" not in units
    for name, params in unit_params(net, units).items():
        assert len({p.requires_grad for p in params}) <= 1, name


@pytest.mark.parametrize("shape", [(7,), (5, 3), (4, 3, 5), (2, 1, 3, 2)])
def test_boxes_cover_a_range_exactly(shape):
    total = math.prod(shape)
    for start in range(total + 1):
        for end in range(start, total + 1):
            covered = []
            for offsets, sizes in boxes(start, end, shape):
                index = torch.arange(total).view(shape)[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
                covered.extend(index.flatten().tolist())
            assert covered == list(range(start, end))


# --- 2 ranks --------------------------------------------------------------------------------------


def _ranks(rank: int, world: int, dirs: dict[str, Path]) -> dict:
    from shardtune.runtime import distributed

    dist_ = distributed.init_worker()
    try:
        return {case: _one_case(rank, world, dist_, dirs[arch], options) for case, (arch, _, options) in CASES.items()}
    finally:
        distributed.teardown()


def _one_case(rank: int, world: int, dist_: Worker, path: Path, options: dict) -> dict:
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
    from transformers import AutoModelForCausalLM

    from shardtune.model.loading import fill_from_full, load, take_snapshot
    from shardtune.model.lora import trainable_names
    from shardtune.parallel import parallelize
    from shardtune.parallel.fsdp1 import gather_full
    from shardtune.runtime.compat import fsdp1_layout

    out: dict = {}
    model_dir = check_model_dir(path)
    cpu = torch.device("cpu")

    # (a) the usual one-unit-per-layer policy on a LoRA model
    model, init = meta_lora(path, options)
    plain = copy.deepcopy(model)
    layer_policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=layer_classes(plain))
    try:
        FullyShardedDataParallel(plain, auto_wrap_policy=layer_policy, device_id=cpu, use_orig_params=False,
                                 param_init_fn=lambda m: m.to_empty(device=cpu, recurse=False))
        out["layer_policy_error"] = None
    except ValueError as err:
        out["layer_policy_error"] = str(err)
    # the public policy in plain FSDP1 code, no shardtune strategy around it
    twin = copy.deepcopy(model)
    twin = FullyShardedDataParallel(twin, auto_wrap_policy=uniform_requires_grad_policy(twin), device_id=cpu,
                                    use_orig_params=False,
                                    param_init_fn=lambda m: m.to_empty(device=cpu, recurse=False))
    # which original parameters each flat parameter holds, by its requires_grad
    out["twin_flat"] = {True: [], False: []}
    for unit_name, unit in twin.named_modules():
        layout = fsdp1_layout(unit) if isinstance(unit, FullyShardedDataParallel) else None
        if layout is not None:
            prefix = unit_name.replace("_fsdp_wrapped_module.", "").removesuffix("_fsdp_wrapped_module")
            out["twin_flat"][layout.flat.requires_grad] += [f"{prefix}.{f}" if prefix else f for f in layout.fqns]

    # (b) ours, loaded shard by shard, against from_pretrained
    names = trainable_names(model)
    out["trainable_names"] = names
    out["trainable_bytes"] = count_params(model)[1] * 4
    strategy = FSDP1(dist_, torch.float32, cpu_offload=False)
    snapshot = take_snapshot(model, init)
    model = parallelize(model, strategy, lambda m: load(m, model_dir, dist_.device, snapshot, strategy), False)
    ids = torch.randint(0, VOCAB, (2 * world, 12), generator=torch.Generator().manual_seed(1))
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        expected = AutoModelForCausalLM.from_pretrained(path)(input_ids=ids).logits
    out["logits_diff"] = (logits - expected).abs().max().item()

    # (d) non-zero lora_B, so that lora_A gets a gradient, written into the shards as loading does
    gen = torch.Generator().manual_seed(2)
    values = {n: torch.randn(v.shape, generator=gen) * 0.1 if "lora_B" in n else v for n, v in init.items()}
    targets = strategy.load_targets(model)
    for n, v in values.items():
        fill_from_full(targets[n], v)
    full = strategy.full_tensors(model, list(values))
    out["full_tensors_match"] = all(torch.equal(full[n], v) for n, v in values.items())
    model.train()
    mine = ids[rank * 2:(rank + 1) * 2]
    model(input_ids=mine, labels=mine).loss.backward()
    grads = gather_full(model, names, grads=True)

    # (c) gradients exist for trainable flat parameters only, sharded
    out["grad_bytes"] = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
    out["frozen_with_grad"] = [n for n, p in model.named_parameters() if not p.requires_grad and p.grad is not None]
    out["trainable_units"] = len(strategy.trainable(model))
    out["grad_norm"] = strategy.clip_grad_norm(model, 0.0)

    # one process, whole batch, same weights
    reference, _ = inject_lora(AutoModelForCausalLM.from_pretrained(path), LoraConfig(**options), seed=0)
    params = dict(reference.named_parameters())
    with torch.no_grad():
        for n, v in values.items():
            params[n].copy_(v)
    reference(input_ids=ids, labels=ids).loss.backward()
    ref_grads = {n: params[n].grad for n in names}
    out["grad_diff"] = max((grads[n] - ref_grads[n]).abs().max().item() for n in names)
    out["grad_scale"] = max(g.abs().max().item() for g in ref_grads.values())
    out["lora_a_grad_nonzero"] = all(grads[n].abs().sum() > 0 for n in names if "lora_A" in n)
    out["ref_grad_norm"] = torch.nn.utils.get_total_norm(list(ref_grads.values())).item()
    return out


@pytest.fixture(scope="module")
def fsdp1_results(model_dirs) -> list[dict]:
    return run_ranks(_ranks, WORLD, model_dirs)


@pytest.mark.parametrize("case", CASES)
def test_layer_policy_fails_and_ours_loads_exactly(fsdp1_results, case):
    for rank in fsdp1_results:
        assert re.search(r"Must flatten tensors with uniform `?requires_grad", rank[case]["layer_policy_error"] or "")
        assert rank[case]["logits_diff"] < 1e-5
        assert rank[case]["full_tensors_match"]
        # the policy in plain FSDP1 code: trainable flat parameters hold exactly the trainable ones
        assert sorted(rank[case]["twin_flat"][True]) == sorted(rank[case]["trainable_names"])
        assert not set(rank[case]["twin_flat"][False]) & set(rank[case]["trainable_names"])


@pytest.mark.parametrize("case", CASES)
def test_only_trainable_gradients_each_rank_a_shard(fsdp1_results, case):
    for rank in fsdp1_results:
        r = rank[case]
        assert r["frozen_with_grad"] == []
        # each trainable flat parameter is padded to a multiple of the world size, at most
        padding = r["trainable_units"] * (WORLD - 1) * 4
        assert r["trainable_bytes"] / WORLD <= r["grad_bytes"] <= r["trainable_bytes"] / WORLD + padding


@pytest.mark.parametrize("case", CASES)
def test_two_rank_gradients_equal_one_process(fsdp1_results, case):
    for rank in fsdp1_results:
        r = rank[case]
        assert r["lora_a_grad_nonzero"]
        assert r["grad_diff"] <= 1e-5 * max(1.0, r["grad_scale"])
        assert r["grad_norm"] == pytest.approx(r["ref_grad_norm"], rel=1e-5)
