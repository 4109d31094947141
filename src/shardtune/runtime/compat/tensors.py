"""torch's private tensor interfaces: fake tensors for the planner's forward pass, storage ids, live bytes, the
oneDNN bf16 probe, a DTensor's own local tensor, and a module's parameter shadowed by a cast copy."""

from __future__ import annotations

import contextlib
import functools
import weakref

import torch
from torch import nn

from shardtune.runtime.compat.changed import PrivateAPIChanged, need

# --- fake tensors for the planner ------------------------------------------------------------------


def fake_mode() -> contextlib.AbstractContextManager:
    """A ``FakeTensorMode`` that also accepts real inputs: shapes and dtypes without memory or arithmetic."""
    try:
        from torch._subclasses.fake_tensor import FakeTensorMode
    except ImportError as err:
        raise PrivateAPIChanged("torch._subclasses.fake_tensor.FakeTensorMode", str(err)) from err
    return FakeTensorMode(allow_non_fake_inputs=True)


def storage_id(t: torch.Tensor) -> int:
    """An id of ``t``'s storage that views share, also for fake tensors (which have no data pointer)."""
    storage = t.untyped_storage()
    need(storage, "torch.UntypedStorage", "_cdata")
    return storage._cdata


class LiveBytes:
    """A dispatch mode counting the bytes of tensor storages alive at once while it is active, and the
    most at any moment (``peak``): what an allocator would hold, found on fake tensors as on real ones.
    A storage counts from the op that makes it until its last reference goes; what views and in-place
    ops return is an input's storage, made before, and is not counted."""

    def __init__(self) -> None:
        try:
            from torch.utils._python_dispatch import TorchDispatchMode
            from torch.utils._pytree import tree_flatten
        except ImportError as err:
            raise PrivateAPIChanged("torch.utils._python_dispatch.TorchDispatchMode", str(err)) from err
        counter = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN202
                out = func(*args, **(kwargs or {}))
                # a view's or an in-place op's result is an input's storage, made before: not new bytes
                made = [r.alias_info is None for r in func._schema.returns]
                for i, result in enumerate(out if isinstance(out, (tuple, list)) else [out]):
                    if i < len(made) and not made[i]:
                        continue
                    for t in tree_flatten(result)[0]:
                        if isinstance(t, torch.Tensor):
                            counter._made(t)
                return out

        self.live = self.peak = 0
        self._refs: dict[int, weakref.ref] = {}
        self._mode = _Mode()

    def _made(self, t: torch.Tensor) -> None:
        key = storage_id(t)
        if key in self._refs:
            return
        storage = t.untyped_storage()
        size = storage.nbytes()
        self.live += size
        self.peak = max(self.peak, self.live)

        def gone(_ref: weakref.ref, key: int = key, size: int = size) -> None:
            self.live -= size
            self._refs.pop(key, None)

        self._refs[key] = weakref.ref(storage, gone)

    def __enter__(self) -> LiveBytes:
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._mode.__exit__(*exc)


def cpu_has_fast_bf16() -> bool:
    """Whether oneDNN multiplies bf16 natively on this CPU (AVX512 or AMX), as torch itself decides it
    (``torch.ops.mkldnn._is_mkldnn_bf16_supported``, private): False when the op is gone, so a torch
    change costs speed (fp32 on such CPUs under ``--dtype auto``), never correctness."""
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    try:
        return bool(check()) if check is not None else False
    except RuntimeError:  # a torch build without oneDNN
        return False


# --- a DTensor's own local tensor ------------------------------------------------------------------


def dtensor_local(t: torch.Tensor) -> torch.Tensor:
    """The tensor object a DTensor holds (``to_local()`` returns a new view, while FSDP2 all-gathers from
    ``_local_tensor`` itself, whose per-tensor fields NF4 loading sets); any other tensor as it is."""
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return t
    need(t, "torch DTensor", "_local_tensor")
    return t._local_tensor


# --- a parameter shadowed by a cast copy ------------------------------------------------------------


def shadow_parameter(module: nn.Module, name: str, dtype: torch.dtype, value: torch.Tensor | None = None) -> None:
    """Make ``module.<name>`` read its registered parameter (or ``value``, e.g. its gathered copy) cast to
    ``dtype`` (autograd carries the gradient back to the parameter) until ``unshadow_parameter``: an instance
    attribute, which ``nn.Module``'s attribute lookup finds before its registered parameters, as FSDP's
    unsharded views do."""
    check_parameter_shadowing()
    module.__dict__[name] = (module._parameters[name] if value is None else value).to(dtype)


def unshadow_parameter(module: nn.Module, name: str) -> None:
    """``module.<name>`` is its registered parameter again."""
    module.__dict__.pop(name, None)


@functools.cache
def check_parameter_shadowing() -> None:
    """An instance attribute must shadow a registered parameter (``nn.Module.__getattr__`` is asked only
    for names the instance lacks), without unregistering it (once per process)."""
    what = "torch.nn.Module's attribute lookup (a parameter shadowed by an instance attribute)"
    probe = nn.Linear(2, 2, bias=False)
    need(probe, what, "_parameters")
    registered = probe._parameters["weight"]
    copy = registered.detach().double()
    probe.__dict__["weight"] = copy
    try:
        seen, listed = probe.weight, dict(probe.named_parameters()).get("weight")
    finally:
        probe.__dict__.pop("weight", None)
    if seen is not copy or listed is not registered or probe.weight is not registered:
        raise PrivateAPIChanged(what, "an instance attribute no longer shadows a registered parameter")
