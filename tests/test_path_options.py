"""Every path option walks the same class of bad paths and gets one message naming option and path (exit 2).

Missing, missing parent, a directory where a file is wanted or the reverse, a FIFO, a socket, a
device file, unreadable, unwritable: refused before anything opens the path (a FIFO opened for
reading blocks until killed; /dev/zero reads until memory runs out), and --out is left as it was.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from shardtune.cli import main

pytestmark = pytest.mark.usefixtures("no_workers")


def _fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def _socket(path: Path) -> Path:
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(path))
    return path


# (how to make the bad path from tmp_path, the words expected after the path)
READ_CASES = {
    "missing": (lambda t: t / "nothing", "does not exist"),
    "missing-parent": (lambda t: t / "no-dir" / "x", "does not exist (nor does its folder"),
    "fifo": (lambda t: _fifo(t / "pipe"), "is a named pipe (FIFO), not a regular file"),
    "socket": (lambda t: _socket(t / "sock"), "is a socket, not a regular file"),
    "device": (lambda t: Path("/dev/zero"), "is a device file, not a regular file"),
}
WRITE_CASES = {
    "missing-parent": (lambda t: t / "no-dir" / "x.log", "cannot be created: its folder"),
    "is-a-directory": (lambda t: t, "is a directory, not a file"),
    "fifo": (lambda t: _fifo(t / "pipe"), "is a named pipe (FIFO), not a regular file"),
    "parent-is-a-file": (lambda t: (t / "f").write_text("x") and t / "f" / "x.log", "cannot be"),
}


def _run(capsys, tiny_llama, train_jsonl, tmp_path, **paths) -> str:
    options = {"model": tiny_llama, "data": train_jsonl, "out": tmp_path / "out", **paths}
    argv = ["finetune", "--steps", "1", "--batch-size", "4"]
    for flag, value in options.items():
        argv += [f"--{flag}", str(value)]
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("error: ") and "Traceback" not in err and err.count("\n") == 1, err
    return err


@pytest.mark.parametrize("case", sorted(READ_CASES))
@pytest.mark.parametrize("flag", ["data", "val-data", "model", "config"])
def test_read_paths(capsys, tiny_llama, train_jsonl, tmp_path, flag, case):
    make, words = READ_CASES[case]
    bad = make(tmp_path)
    if flag == "model" and case in ("missing", "missing-parent"):
        words = "does not exist"  # a missing model may be a Hub id: model/hub.py says so
    err = _run(capsys, tiny_llama, train_jsonl, tmp_path, **{flag: bad})
    assert str(bad) in err and words in err, err
    if flag != "config":
        assert f"'{flag}'" in err or flag == "model", err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("case", sorted(WRITE_CASES))
def test_log_file(capsys, tiny_llama, train_jsonl, tmp_path, case):
    make, words = WRITE_CASES[case]
    bad = make(tmp_path)
    err = _run(capsys, tiny_llama, train_jsonl, tmp_path, **{"log-file": bad})
    assert f"option 'log-file': {bad}" in err and words in err, err


@pytest.mark.parametrize("case", ["file", "fifo", "parent-is-a-file", "model-dir", "inside-model-dir"])
def test_out(capsys, tiny_llama, train_jsonl, tmp_path, case):
    bad = {"file": lambda: (tmp_path / "f").write_text("x") and tmp_path / "f",
           "fifo": lambda: _fifo(tmp_path / "pipe"),
           "parent-is-a-file": lambda: (tmp_path / "f").write_text("x") and tmp_path / "f" / "out",
           "model-dir": lambda: tiny_llama,
           "inside-model-dir": lambda: tiny_llama / "run"}[case]()
    err = _run(capsys, tiny_llama, train_jsonl, tmp_path, out=bad)
    assert f"option 'out': {bad}" in err, err
    assert not (tiny_llama / "run").exists() and not (tiny_llama / "config.yaml").exists()


def test_unreadable_and_unwritable(capsys, tiny_llama, train_jsonl, tmp_path, monkeypatch):
    """root reads and writes anything: permissions are faked through os.access, which the check asks."""
    real = os.access
    denied = tmp_path / "denied"
    denied.mkdir()
    (denied / "d.jsonl").write_text(train_jsonl.read_text())
    monkeypatch.setattr(os, "access", lambda p, mode: False if str(p).startswith(str(denied)) else real(p, mode))
    err = _run(capsys, tiny_llama, train_jsonl, tmp_path, data=denied / "d.jsonl")
    assert f"option 'data': {denied / 'd.jsonl'} cannot be read: permission denied" in err
    err = _run(capsys, tiny_llama, train_jsonl, tmp_path, out=denied / "out")
    assert f"option 'out': {denied / 'out'} cannot be created: permission denied" in err
    err = _run(capsys, tiny_llama, train_jsonl, tmp_path, **{"log-file": denied / "x.log"})
    assert f"option 'log-file': {denied / 'x.log'} cannot be created: permission denied" in err


def test_token_cache_that_is_a_file(capsys, tiny_llama, train_jsonl, tmp_path, monkeypatch):
    (tmp_path / "cache").write_text("x")
    monkeypatch.setenv("SHARDTUNE_CACHE", str(tmp_path / "cache"))
    err = _run(capsys, tiny_llama, train_jsonl, tmp_path)
    assert "the token cache ($SHARDTUNE_CACHE/tokenized)" in err and "is a file, not a directory" in err


def test_fifo_as_data_through_python_m_shardtune_does_not_hang(tiny_llama, tmp_path):
    pipe = _fifo(tmp_path / "pipe")
    done = subprocess.run([sys.executable, "-m", "shardtune", "finetune", "--model", str(tiny_llama), "--data",
                           str(pipe), "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and f"option 'data': {pipe} is a named pipe (FIFO)" in done.stderr, done.stderr


def test_fifo_as_adapter_config_does_not_hang(capsys, tiny_llama, tmp_path):
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    _fifo(adapter / "adapter_config.json")
    assert main(["generate", "--model", str(tiny_llama), "--adapter", str(adapter), "--prompt", "hi"]) == 2
    assert "adapter_config.json" in capsys.readouterr().err  # is_file() is False for a FIFO: never opened
