"""The error every layout check raises, and the check that an object has the attributes relied on."""

from __future__ import annotations

import torch


class PrivateAPIChanged(RuntimeError):
    """A private torch/peft/torchao interface is not what this shardtune version was written against."""

    def __init__(self, what: str, detail: str) -> None:
        super().__init__(
            f"{what}: {detail}. shardtune relies on this private interface (runtime/compat/) and it changed "
            f"(torch {torch.__version__}{versions()}); use the versions pinned in pyproject.toml "
            "or update runtime/compat/"
        )


def versions() -> str:
    """", peft X, torchao Y" for those of them imported in this process."""
    import sys

    return "".join(f", {name} {getattr(sys.modules[name], '__version__', '?')}"
                   for name in ("peft", "torchao") if name in sys.modules)


def need(obj: object, what: str, *attrs: str) -> None:
    missing = [a for a in attrs if not hasattr(obj, a)]
    if missing:
        raise PrivateAPIChanged(what, f"{type(obj).__name__} has no {', '.join(missing)}")
