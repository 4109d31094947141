"""Fixtures several test files share: one tiny model and one data file per session, made once.

The shared files are read-only by convention: a test that changes a model or data file makes its own
(``tiny.make_model``, ``tiny.write_jsonl``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tiny import instruction_records, make_model, write_jsonl


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
