"""The private-API fence: each check passes on this torch/peft and fails loudly when the layout changes."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch
import torch.distributed.checkpoint as dcp

from shardtune.runtime import compat
from shardtune.runtime.compat import PrivateAPIChanged, ShardView, fsdp1_layout


def _fake_unit(rank: int, infos: list[tuple] | None = None, **overrides) -> SimpleNamespace:
    """An FSDP1 unit holding a (3,) and a (2, 2) parameter with one element of alignment padding
    between them: unpadded flat [p0 p0 p0 pad p1 p1 p1 p1], 2 ranks of 4 elements."""
    flat = torch.nn.Parameter(torch.zeros(4), requires_grad=False)
    flat._fqns, flat._shapes = ("a.weight", "b.weight"), (torch.Size([3]), torch.Size([2, 2]))
    flat._numels_with_padding, flat._is_padding_mask = (3, 1, 4), (False, True, False)
    flat._unpadded_unsharded_size = torch.Size([8])
    flat._shared_param_infos = []
    info = SimpleNamespace
    by_rank = {0: [info(in_shard=True, offset_in_shard=0, numel_in_shard=3),
                   info(in_shard=False, offset_in_shard=None, numel_in_shard=None)],
               1: [info(in_shard=False, offset_in_shard=None, numel_in_shard=None),
                   info(in_shard=True, offset_in_shard=0, numel_in_shard=4)]}
    flat._shard_param_infos = [info(in_shard=a, offset_in_shard=b, numel_in_shard=c) for a, b, c in infos] \
        if infos is not None else by_rank[rank]
    for name, value in overrides.items():
        setattr(flat, name, value)
    return SimpleNamespace(_handle=SimpleNamespace(flat_param=flat, world_size=2, rank=rank, process_group=None))


@pytest.mark.parametrize("rank", [0, 1])
def test_fsdp1_layout_matches_fsdp1s_records(rank: int) -> None:
    layout = fsdp1_layout(_fake_unit(rank))
    assert layout.offsets == (0, 4)  # the padding element sits between the parameters
    assert [layout.local_range(i) for i in range(2)] == ([(0, 3), (0, 0)] if rank == 0 else [(3, 3), (0, 4)])


@pytest.mark.parametrize("change", [
    {"infos": [(True, 1, 3), (False, None, None)]},  # FSDP1 would read p0 from another place
    {"_numels_with_padding": (3, 4), "_is_padding_mask": (False, False)},  # padding between params gone
    {"_unpadded_unsharded_size": torch.Size([9])},  # padding at the end that the shards do not hold
])
def test_fsdp1_layout_refuses_a_changed_padding_layout(change: dict) -> None:
    with pytest.raises(PrivateAPIChanged, match="FSDP1 FlatParameter.*runtime/compat/"):
        fsdp1_layout(_fake_unit(0, **change))


def test_fsdp1_layout_names_a_missing_internal() -> None:
    unit = _fake_unit(0)
    del unit._handle.flat_param._shard_param_infos
    with pytest.raises(PrivateAPIChanged, match="_shard_param_infos"):
        fsdp1_layout(unit)


def test_dcp_loads_only_a_shard_views_pieces(tmp_path) -> None:
    full = torch.arange(12, dtype=torch.float32).view(3, 4)
    dcp.save({"w": full}, checkpoint_id=str(tmp_path), no_dist=True)
    compat.check_load_target_protocol()
    # Rows 1.. from column 2 on, as a flat range [6, 12) is cut: a partial row, then a whole one.
    flat = torch.full((6,), -1.0)
    pieces = [((1, 2), flat[:2].view(1, 2)), ((2, 0), flat[2:].view(1, 4))]
    dcp.load({"w": ShardView((3, 4), torch.float32, flat.device, pieces)}, checkpoint_id=str(tmp_path),
             no_dist=True)
    assert flat.tolist() == full.reshape(-1)[6:].tolist()
    with pytest.raises(TypeError, match="load target"):
        ShardView((3, 4), torch.float32, flat.device, pieces).sum()


def test_peft_hook_fails_loudly_when_peft_renames_it(monkeypatch) -> None:
    from peft.tuners.tuners_utils import BaseTunerLayer

    monkeypatch.delattr(BaseTunerLayer, "_move_adapter_to_device_of_base_layer")
    with pytest.raises(PrivateAPIChanged, match="_move_adapter_to_device_of_base_layer"):
        with compat.record_lora_init(lambda layer: None):
            pass


def test_all_gather_interface_check(monkeypatch) -> None:
    from torch.distributed.fsdp._fully_shard import _fsdp_api

    compat.check_fsdp2_comm_interface.__wrapped__("FSDP2", "AllGather")  # this torch: passes

    def changed(self, output_tensor, input_tensor, group, stream, async_op=False):
        return None

    monkeypatch.setattr(_fsdp_api.AllGather, "__call__", changed)
    with pytest.raises(PrivateAPIChanged, match="stream"):
        compat.check_fsdp2_comm_interface.__wrapped__("FSDP2", "AllGather")


def test_reduce_scatter_interface_check(monkeypatch) -> None:
    from torch.distributed.fsdp._fully_shard import _fsdp_api

    compat.check_fsdp2_comm_interface.__wrapped__("FSDP2", "ReduceScatter")  # this torch: passes

    def changed(self, output_tensor, input_tensor, group, op, stream, async_op=False):
        return None

    monkeypatch.setattr(_fsdp_api.ReduceScatter, "__call__", changed)
    with pytest.raises(PrivateAPIChanged, match="stream"):
        compat.check_fsdp2_comm_interface.__wrapped__("FSDP2", "ReduceScatter")


def test_nf4_method_routing_fails_loudly_when_torchao_computes_otherwise() -> None:
    """A torchao whose NF4 method gives other values than shardtune's replacement (or lost it) fails by
    name at import, instead of quantizing differently."""

    class NF4Tensor:
        def get_original_weight(self):
            return 1

    module = SimpleNamespace(NF4Tensor=NF4Tensor)
    with pytest.raises(PrivateAPIChanged, match="NF4Tensor.get_original_weight: it gives other values"):
        compat.route_nf4_method(module, "get_original_weight", lambda self: 2, lambda original: False)
    assert NF4Tensor().get_original_weight() == 1  # left as torchao wrote it
    with pytest.raises(PrivateAPIChanged, match="NF4Tensor.quantize_tensor_nearest: it does not exist"):
        compat.route_nf4_method(module, "quantize_tensor_nearest", lambda v, lut: v, lambda original: True)
    compat.route_nf4_method(module, "get_original_weight", lambda self: 2, lambda original: original(None) == 1)
    assert NF4Tensor().get_original_weight() == 2 and NF4Tensor()._torchao_get_original_weight() == 1


def test_a_shadowed_parameter_computes_in_its_copy_and_its_gradient_reaches_the_parameter() -> None:
    compat.check_parameter_shadowing.__wrapped__()  # this torch: an instance attribute shadows a parameter
    layer = torch.nn.Linear(4, 3, bias=False)
    compat.shadow_parameter(layer, "weight", torch.float64)
    out = layer(torch.ones(2, 4, dtype=torch.float64))
    assert out.dtype == torch.float64 and layer.weight.dtype == torch.float64
    out.sum().backward()
    compat.unshadow_parameter(layer, "weight")
    assert layer.weight is layer._parameters["weight"] and layer.weight.grad.dtype == torch.float32
    assert torch.equal(layer.weight.grad, torch.full((3, 4), 2.0))


def _hooks_paused_on_one_rank(rank: int, world_size: int) -> dict:
    from torch.distributed.fsdp import fully_shard

    from shardtune.runtime import distributed

    distributed.init_worker()
    unit = fully_shard(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    mine = unit.register_forward_pre_hook(lambda m, a: None)  # registered after FSDP2's: must stay, in order
    before = list(unit._forward_pre_hooks), list(unit._forward_hooks)
    with compat.fsdp2_forward_hooks_paused(unit):
        during = list(unit._forward_pre_hooks), list(unit._forward_hooks)
    after = list(unit._forward_pre_hooks), list(unit._forward_hooks)
    out = unit(torch.ones(1, 4))  # FSDP2's hooks work again: the sharded weight is gathered for the forward
    distributed.teardown()
    return {"before": before, "during": during, "after": after, "mine": mine.id, "finite": bool(out.isfinite().all())}


def test_fsdp2_forward_hooks_are_paused_and_put_back_in_order() -> None:
    from dist_utils import run_ranks

    (r,) = run_ranks(_hooks_paused_on_one_rank, 1)
    assert r["after"] == r["before"] and r["finite"]
    assert r["during"] == ([r["mine"]], [])  # only FSDP2's own left out


def _frozen_shards_released(rank: int, world_size: int) -> dict:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from shardtune.runtime import distributed

    distributed.init_worker()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Linear(5, 3))  # 5 rows: rank 1's shard is padded
    model[0].requires_grad_(False)  # frozen, as a base; model[1] trains, as LoRA
    whole = {n: p.detach().clone() for n, p in model.named_parameters()}
    x = torch.randn(2, 4)
    expected = model(x)
    fully_shard(model[0])
    unit = fully_shard(model)
    cast = fully_shard(torch.nn.Linear(4, 4).requires_grad_(False),
                       mp_policy=MixedPrecisionPolicy(param_dtype=torch.float64))  # gathered copy in another dtype
    units = [model[0], unit]
    padded = {id(p): p._sharded_param_data.clone() for u in units
              for p in u._get_fsdp_state()._fsdp_param_group.fsdp_params}
    sharded = dict(model.named_parameters())  # the DTensors; gathered, the module holds plain copies
    result: dict = {}
    for failing in (False, True):
        try:
            with contextlib.ExitStack() as stack:
                freed = []
                for u in [*units, cast]:
                    u.unshard()
                    freed.append(stack.enter_context(compat.fsdp2_frozen_shards_released(u)))
                    stack.enter_context(compat.fsdp2_forward_hooks_paused(u))
                result["freed"] = freed
                result["held"] = {n: p.to_local().untyped_storage().nbytes() for n, p in sharded.items()}
                with torch.no_grad():
                    result["same_during"] = torch.equal(model(x), expected)
                if failing:
                    raise KeyError("generation failed")
        except KeyError:
            pass
        for u in [*units, cast]:
            u.reshard()
        result[f"refilled_{failing}"] = all(
            torch.equal(p._sharded_param_data, padded[id(p)])
            for u in units for p in u._get_fsdp_state()._fsdp_param_group.fsdp_params)
        with torch.no_grad():  # through FSDP2's hooks: gathered from the refilled shards
            result[f"same_after_{failing}"] = torch.equal(model(x), expected)
        for u in units:
            u.reshard()
    result["gathered_whole"] = all(torch.equal(p.full_tensor(), whole[n]) for n, p in model.named_parameters())
    distributed.teardown()
    return result


def test_fsdp2_frozen_shards_are_freed_while_gathered_and_refilled_bit_for_bit() -> None:
    """Held gathered, a rank holds its frozen weights once: the shards, rows of the gathered copy, are freed
    and refilled from it when the block ends (padding too, on the rank whose rows do not fill its shard),
    also when the block fails; trainable shards and a gathered copy cast to another dtype are left alone."""
    from dist_utils import run_ranks

    for rank, r in enumerate(run_ranks(_frozen_shards_released, 2)):
        rows = 3 if rank == 0 else 2  # of the frozen weight's 5; rank 1's shard holds a padding row
        assert r["freed"] == [(3 * 4 + 3) * 4, 0, 0], r["freed"]  # the padded weight and bias shards
        assert r["held"]["0.weight"] == r["held"]["0.bias"] == 0
        assert r["held"]["1.weight"] > 0 and r["held"]["1.bias"] > 0, (rows, r["held"])
        assert r["same_during"], "the gathered copy was freed with the shard"
        assert r["refilled_False"] and r["refilled_True"] and r["same_after_False"] and r["same_after_True"]
        assert r["gathered_whole"]


def _held_into_training(rank: int, world_size: int) -> dict:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group

    from shardtune.runtime import distributed

    distributed.init_worker()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Linear(5, 3))  # 5 rows: rank 1's shard is padded
    model[0].requires_grad_(False)  # frozen, as a base; model[1] trains, as LoRA
    x = torch.randn(2, 4) + rank
    fully_shard(model[0])
    unit = fully_shard(model)
    units = [model[0], unit]
    params = [p for u in units for p in u._get_fsdp_state()._fsdp_param_group.fsdp_params]
    padded = {id(p): p._sharded_param_data.clone() for p in params}
    gathers = [0]
    real = _fsdp_param_group.foreach_all_gather

    def counted(*args, **kwargs):
        gathers[0] += 1
        return real(*args, **kwargs)
    _fsdp_param_group.foreach_all_gather = counted

    def trained() -> tuple[int, torch.Tensor]:
        gathers[0] = 0
        model(x).square().sum().backward()
        grad = model[1].weight.grad.full_tensor().clone()
        model.zero_grad()
        return gathers[0], grad

    result: dict = {"plain": trained()}
    for failing in (False, True):
        try:
            with contextlib.ExitStack() as stack:
                for u in units:
                    u.unshard()
                    stack.enter_context(compat.fsdp2_frozen_shards_released(u, hold=lambda: True))
                    stack.enter_context(compat.fsdp2_forward_hooks_paused(u))
                with torch.no_grad():
                    model(x)  # a generation's forwards
                if failing:
                    raise KeyError("generation failed")
        except KeyError:
            result["refilled_on_error"] = all(torch.equal(p._sharded_param_data, padded[id(p)]) for p in params)
            for u in units:
                u.reshard()
            continue
        group = model[0]._get_fsdp_state()._fsdp_param_group
        result["still_freed"] = group.fsdp_params[0]._sharded_param_data.untyped_storage().nbytes() == 0
        result["held"] = trained()
        result["sharded_after"] = all(u._get_fsdp_state()._fsdp_param_group.is_sharded for u in units)
        result["refilled"] = all(torch.equal(p._sharded_param_data, padded[id(p)]) for p in params)
        result["reshards_after_forward_again"] = group.post_forward_mesh_info is not None
        result["again"] = trained()
    _fsdp_param_group.foreach_all_gather = real
    distributed.teardown()
    return result


def test_fsdp2_units_held_from_generation_into_training_gather_nothing_and_match() -> None:
    """A generation's gathered units held into training (``hold``): its forward and backward gather none of
    them and give the same gradients; its backward shards every unit, each frozen shard refilled bit for bit
    first, and FSDP2 is as before (the next step gathers and reshards after forward again). A failed block
    refills at once."""
    from dist_utils import run_ranks

    for r in run_ranks(_held_into_training, 2):
        gathers, grad = r["plain"]
        assert gathers >= 2, gathers  # each unit at least once: the count sees FSDP2's gathers
        assert r["still_freed"], "the frozen shard came back before the training that should use the gathered copy"
        assert r["held"][0] == 0, f"held units were gathered again {r['held'][0]} times"
        assert torch.equal(r["held"][1], grad)
        assert r["sharded_after"] and r["refilled"] and r["reshards_after_forward_again"]
        assert r["again"][0] == gathers and torch.equal(r["again"][1], grad)
        assert r["refilled_on_error"]


def test_fsdp2_forward_hooks_paused_names_a_missing_internal() -> None:
    with pytest.raises(PrivateAPIChanged, match="_get_fsdp_state"):
        with compat.fsdp2_forward_hooks_paused(torch.nn.Linear(2, 2)):
            pass
