"""How the tests compare a result with its oracle's: relative to the tensor's own scale."""

from __future__ import annotations

import torch


def rel(a: torch.Tensor | float, b: torch.Tensor | float, floor: float = 1e-12) -> float:
    """max |a − b| / max |b|; ``floor``: the least denominator (for values that are ~0 by construction).

    Why not element by element: fp32 sums in another order (other kernels on another CPU kind, TRL's
    batching against ours) round each element by ~1e-7 of the largest terms summed into it, so an element far
    below its tensor's scale can differ by 1e-5 of itself while the tensor agrees to 1e-7 of its scale."""
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return ((a - b).abs().max() / b.abs().max().clamp(min=floor)).item()
