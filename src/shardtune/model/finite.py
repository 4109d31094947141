"""Whether a tensor's values are all finite, the one check every weight goes through (loading a base, reading
an adapter, merging one into a base)."""

from __future__ import annotations

import torch


def all_finite(t: torch.Tensor) -> bool:
    """Whether every value of ``t`` is finite, from its least and greatest (NaN propagates into both, each
    infinity shows in one): one reading pass, where ``isfinite(t).all()`` also writes a flag per value into a
    fresh buffer the size of the tensor. Non-float tensors are finite."""
    if not t.is_floating_point() or not t.numel():
        return True
    try:
        return bool(torch.isfinite(torch.stack(torch.aminmax(t))).all())
    except (RuntimeError, NotImplementedError):  # a dtype aminmax lacks (float8 on some builds)
        return bool(torch.isfinite(t).all())
