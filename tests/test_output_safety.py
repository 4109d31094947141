"""Rule: nothing already on disk is lost. Outputs that exist, hold an input or cannot be written are refused
before anything is written; a write that fails leaves no temporary folder and names the path."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from shardtune.cli import main
from shardtune.errors import ShardtuneError
from shardtune.runtime.files import output_error, staged_dir
from shardtune.runtime.outputs import check_output
from test_merge import _random_adapter

from tiny import make_model


@pytest.fixture(scope="module")
def base_and_adapter(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("outsafe")
    make_model(root / "base", "llama")
    _random_adapter(root / "base", root / "adapter", {})
    return root / "base", root / "adapter"


def _tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_merge_refuses_a_non_empty_output_unless_overwrite(base_and_adapter, tmp_path, capsys):
    base, adapter = base_and_adapter
    out = tmp_path / "out"
    (out / "keep").mkdir(parents=True)
    (out / "notes.txt").write_text("mine")
    (out / "keep" / "a.txt").write_text("also mine")
    before = _tree(out)
    args = ["merge", "--model", str(base), "--adapter", str(adapter), "--out", str(out)]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert f"output directory {out} already exists and is not empty" in err and "--overwrite" in err
    assert _tree(out) == before
    assert main([*args, "--overwrite"]) == 0
    assert (out / "model.safetensors").is_file() and not (out / "notes.txt").exists()
    assert not list(tmp_path.glob(".out*"))


@pytest.mark.parametrize("which", ["model", "parent-of-model", "adapter"])
def test_merge_never_writes_over_its_input(base_and_adapter, capsys, which):
    base, adapter = base_and_adapter
    out = {"model": base, "parent-of-model": base.parent, "adapter": adapter}[which]
    before = _tree(base) | _tree(adapter)
    assert main(["merge", "--model", str(base), "--adapter", str(adapter), "--out", str(out), "--overwrite"]) == 2
    assert "would replace the input" in capsys.readouterr().err
    assert _tree(base) | _tree(adapter) == before


def test_output_that_is_a_file_or_read_only(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ShardtuneError, match="is an existing file"):
        check_output(tmp_path / "file", kind="dir", overwrite=True)
    with pytest.raises(ShardtuneError, match="is a file, not a directory"):
        check_output(tmp_path / "file" / "sub", kind="dir", overwrite=True)


def test_output_on_a_read_only_file_system(tmp_path, monkeypatch):
    import shardtune.runtime.files as files

    # Root may write anywhere, so the refusal a user sees is produced by faking what the OS reports.
    monkeypatch.setattr(files.os, "access", lambda path, mode: False)
    monkeypatch.setattr(files, "_read_only", lambda path: True)
    with pytest.raises(ShardtuneError, match=f"cannot write {tmp_path / 'new'}: the file system is read-only"):
        check_output(tmp_path / "new", kind="dir", overwrite=False)


def test_adapter_from_checkpoint_refuses_to_write_over_its_run(tmp_path, capsys):
    ckpt = tmp_path / "run" / "checkpoints" / "step-2"
    ckpt.mkdir(parents=True)
    (ckpt / "COMPLETE").write_text("")
    out = tmp_path / "taken"
    out.mkdir()
    (out / "x").write_text("x")
    assert main(["adapter-from-checkpoint", str(ckpt), str(tmp_path / "run"), "--overwrite"]) == 2
    assert "would replace the input" in capsys.readouterr().err
    assert main(["adapter-from-checkpoint", str(ckpt), str(out)]) == 2
    assert "already exists and is not empty" in capsys.readouterr().err
    assert (out / "x").read_text() == "x" and (ckpt / "COMPLETE").is_file()


def test_a_failed_staged_write_leaves_nothing_and_names_the_path(tmp_path):
    final = tmp_path / "adapter"
    final.mkdir()
    (final / "old.txt").write_text("old")
    with pytest.raises(ShardtuneError, match=r"cannot write .*big\.bin: no space left on the device"):
        with staged_dir(final) as tmp:
            (tmp / "part").write_text("half")
            raise OSError(errno.ENOSPC, "No space left on device", str(tmp / "big.bin"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter"]
    assert (final / "old.txt").read_text() == "old"
    with pytest.raises(ValueError):  # any failure, not only OSError, removes the temporary folder
        with staged_dir(final):
            raise ValueError("boom")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter"]
    assert str(output_error(OSError(errno.EROFS, "x"), "/o/p")) == "cannot write /o/p: the file system is read-only"


def test_a_checkpoint_write_on_a_full_disk_names_the_file(tmp_path):
    import traceback

    from torch.distributed.checkpoint.api import CheckpointException

    from shardtune.train.checkpoint import _write_error

    full = OSError(errno.ENOSPC, "No space left on device", str(tmp_path / ".step-4.tmp" / "__0_0.distcp"))
    err = CheckpointException("save failed", {0: (full, traceback.StackSummary())})
    assert str(_write_error(err, tmp_path / ".step-4.tmp")) == \
        f"cannot write {tmp_path / '.step-4.tmp' / '__0_0.distcp'}: no space left on the device"
