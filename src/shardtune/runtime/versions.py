"""What shardtune needs from torch and transformers that older releases lack, checked in one place.

A too-old release must fail at once with the version to install, never run on a silent fallback
(``getattr(model, "all_tied_weights_keys", None) or {}`` on transformers 4.x left tied weights
untied). The floors in pyproject.toml are the oldest releases the suite has passed on
(scripts/test-oldest.sh); the checks below name what breaks below them.
"""

from __future__ import annotations

from collections.abc import Callable

from shardtune.errors import ShardtuneError


class MissingAPIError(ShardtuneError, RuntimeError):
    """An installed library is too old for shardtune; the message says which and what to install."""


def _torch_apis() -> list[tuple[str, Callable[[], object]]]:
    import torch

    def dcp_hf_reader() -> object:
        import torch.distributed.checkpoint as dcp

        return dcp.HuggingFaceStorageReader

    def fsdp2_custom_all_gather() -> object:
        from torch.distributed.fsdp import FSDPModule

        return FSDPModule.set_custom_all_gather

    return [
        ("torch.distributed.checkpoint.HuggingFaceStorageReader (shard-only loading)", dcp_hf_reader),
        ("FSDPModule.set_custom_all_gather (FSDP2 on gloo)", fsdp2_custom_all_gather),
        ("torch.nn.utils.get_total_norm / clip_grads_with_norm_", lambda: (torch.nn.utils.get_total_norm,
                                                                           torch.nn.utils.clip_grads_with_norm_)),
    ]


def check_apis() -> None:
    """Raise MissingAPIError naming every missing API of torch and transformers, with the fix."""
    import torch
    import transformers

    missing = []
    for what, get in _torch_apis():
        try:
            get()
        except (ImportError, AttributeError):
            missing.append(f"torch {torch.__version__} lacks {what}")
    from transformers import PreTrainedModel

    if not hasattr(PreTrainedModel, "get_expanded_tied_weights_keys"):
        missing.append(f"transformers {transformers.__version__} lacks all_tied_weights_keys (transformers 5)")
    if missing:
        raise MissingAPIError("; ".join(missing) + ". Install the versions pyproject.toml requires: "
                              "pip install 'torch>=2.13' 'transformers>=5.1' 'peft>=0.19'")


def tied_weights_keys(model: object) -> dict[str, str]:
    """{tied parameter: the parameter it shares}, from transformers 5's ``all_tied_weights_keys``."""
    keys = getattr(model, "all_tied_weights_keys", None)
    if keys is None:
        import transformers

        raise MissingAPIError(
            f"{type(model).__name__} has no all_tied_weights_keys: transformers {transformers.__version__} is "
            "older than 5.0, and its tied weights would be left untied. pip install 'transformers>=5.1'"
        )
    return dict(keys)
