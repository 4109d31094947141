"""Suite-wide settings and the fixtures several test files share.

GPU machines: the CPU suite must run there unchanged, on CPU and gloo, so ``--device auto`` means
cpu for every test and every worker process it starts (``SHARDTUNE_DEVICE``, read by
runtime/device.py). Tests marked ``gpu`` ask for ``cuda`` explicitly and are skipped, saying why,
where there is no GPU (or too few for their ranks).

Shared fixtures: one tiny model and one data file per session, made once. The shared files are
read-only by convention: a test that changes a model or data file makes its own
(``tiny.make_model``, ``tiny.write_jsonl``).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tiny import instruction_records, make_model, write_jsonl

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


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer Llama with tied embeddings (tests/tiny.py), in fp32."""
    return make_model(tmp_path_factory.mktemp("shared") / "llama-tied", "llama", tied=True)


@pytest.fixture(scope="session")
def train_jsonl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """20 instruction records: 5 global batches of 4."""
    return write_jsonl(tmp_path_factory.mktemp("shared") / "train.jsonl", instruction_records(20))


@pytest.fixture(scope="module")
def run_root(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path, train_jsonl: Path) -> Path:
    """A fresh directory for one test module's runs, with ``model`` and ``train.jsonl`` linked in."""
    root = tmp_path_factory.mktemp("runs")
    (root / "model").symlink_to(tiny_llama, target_is_directory=True)
    (root / "train.jsonl").symlink_to(train_jsonl)
    return root


@pytest.fixture(scope="module")
def one_thread():
    """torch on one thread for a module of tiny in-process models: their matmuls are too small to share, and
    on a loaded machine two threads' spinning OpenMP workers make them 10x slower."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def no_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if a fine-tune would start workers: for tests of what must be refused before that."""
    import shardtune.launch

    def launch(cfg, plan, asked=None):  # pragma: no cover - reached only when bad input got past the checks
        raise AssertionError("the checks passed: workers would have been started")

    monkeypatch.setattr(shardtune.launch, "launch", launch)


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path, train_jsonl: Path) -> Path:
    """A finished fine-tune's --out (3 steps, a checkpoint after each, all kept): config.yaml, metrics.jsonl,
    summary.json, adapter/, checkpoints/step-{1,2,3}. Read-only by convention: a test that changes it
    works on a copy (``shutil.copytree``) and passes ``--out`` to a resume."""
    from shardtune.cli import main

    out = tmp_path_factory.mktemp("trained") / "run"
    code = main(["finetune", "--model", str(tiny_llama), "--data", str(train_jsonl), "--out", str(out),
                 "--dtype", "fp32", "--steps", "3", "--batch-size", "4", "--seq-len", "64", "--strategy", "single",
                 "--save-every", "1", "--keep-last", "3", "--lr", "1e-3"])
    assert code == 0, "the shared fine-tune failed"
    return out
