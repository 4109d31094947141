"""Suite-wide settings (shared fixtures may live here too).

GPU machines: the CPU suite must run there unchanged, on CPU and gloo, so ``--device auto`` means
cpu for every test and every worker process it starts (``SHARDTUNE_DEVICE``, read by
runtime/device.py). Tests marked ``gpu`` ask for ``cuda`` explicitly and are skipped, saying why,
where there is no GPU (or too few for their ranks).
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("SHARDTUNE_DEVICE", "cpu")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu(ranks=1): needs CUDA and `ranks` GPUs (one per NCCL rank)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        marker = item.get_closest_marker("gpu")
        if marker is None:
            continue
        ranks = marker.kwargs.get("ranks", 1)
        if not gpus:
            item.add_marker(pytest.mark.skip(reason=f"needs a CUDA GPU; torch {torch.__version__} sees none"))
        elif gpus < ranks:
            item.add_marker(pytest.mark.skip(
                reason=f"needs {ranks} GPUs (NCCL refuses two ranks on one GPU); this machine has {gpus}"))
