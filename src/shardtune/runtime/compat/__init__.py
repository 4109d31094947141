"""Every private torch, peft and torchao interface shardtune relies on, each behind a check of its layout.

A new torch, peft or torchao may rename or reshape any of these without notice. Each function here
checks what it relies on and raises ``PrivateAPIChanged`` naming the interface and what differed,
instead of returning wrong slices or silently skipping work. Nothing outside this package touches them.

* ``fsdp.py``: FSDP1 flat parameters (``FlatParamHandle``): where each original parameter lies in the
  flat parameter and in this rank's slice of it (``fsdp1_layout``); FSDP2's custom all-gather and
  reduce-scatter (``set_fsdp2_all_gather``/``set_fsdp2_reduce_scatter``, their call signatures checked
  by ``check_fsdp2_comm_interface``); a unit's forwards run without its hooks
  (``fsdp2_forward_hooks_paused``) and, held gathered, its frozen shards freed until refilled from the gathered
  copy (``fsdp2_frozen_shards_released``), or held so into the training that follows until FSDP2 shards it
  (``fsdp2_held_until_resharded``); the collectives themselves are in parallel/gloo_comms.py.
* ``dcp.py``: DCP's load-target protocol (``__create_chunk_list__`` / ``__get_tensor_shard__``):
  ``ShardView``, a tensor made of rectangles of a parameter, which ``dcp.load`` fills.
* ``peft_layers.py``: peft's per-adapter device move, wrapped to record LoRA's initial values
  (``record_lora_init``); the adapter layers' own switch (``adapters_disabled``).
* ``tensors.py``: fake tensors for the planner's passes (``fake_mode``, ``storage_id``, ``LiveBytes``), oneDNN's
  bf16 probe (``cpu_has_fast_bf16``), a DTensor's own local tensor (``dtensor_local``), and a module's
  parameter shadowed by a copy in the compute dtype (``shadow_parameter``: parallel/compute_dtype.py).
* ``nf4.py``: torchao's NF4 tensor module and fields (``nf4_tensor_module``), and two of its methods and
  its ``F.linear`` routed through shardtune's bit-exact replacements (``route_nf4_method``,
  ``route_nf4_torch_function``: model/nf4_torchao.py).
"""

from __future__ import annotations

from shardtune.runtime.compat.changed import PrivateAPIChanged
from shardtune.runtime.compat.dcp import ShardView, check_load_target_protocol, piece_boxes
from shardtune.runtime.compat.fsdp import (
    FSDP2_COMM_CALLS,
    FlatLayout,
    check_fsdp2_comm_interface,
    fsdp1_flat_param,
    fsdp1_layout,
    fsdp2_forward_hooks_paused,
    fsdp2_frozen_shards_released,
    fsdp2_held_until_resharded,
    set_fsdp2_all_gather,
    set_fsdp2_reduce_scatter,
)
from shardtune.runtime.compat.nf4 import nf4_tensor_module, route_nf4_method, route_nf4_torch_function
from shardtune.runtime.compat.peft_layers import adapters_disabled, record_lora_init
from shardtune.runtime.compat.tensors import (
    LiveBytes,
    check_parameter_shadowing,
    cpu_has_fast_bf16,
    dtensor_local,
    fake_mode,
    shadow_parameter,
    storage_id,
    unshadow_parameter,
)

__all__ = [
    "FSDP2_COMM_CALLS", "FlatLayout", "LiveBytes", "PrivateAPIChanged", "ShardView", "adapters_disabled",
    "check_fsdp2_comm_interface", "check_load_target_protocol", "check_parameter_shadowing", "cpu_has_fast_bf16",
    "dtensor_local", "fake_mode", "fsdp1_flat_param", "fsdp1_layout", "fsdp2_forward_hooks_paused",
    "fsdp2_frozen_shards_released", "fsdp2_held_until_resharded", "nf4_tensor_module", "piece_boxes",
    "record_lora_init", "route_nf4_method", "route_nf4_torch_function", "set_fsdp2_all_gather",
    "set_fsdp2_reduce_scatter", "shadow_parameter", "storage_id", "unshadow_parameter",
]
