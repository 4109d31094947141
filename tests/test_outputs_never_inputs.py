"""Rule: an output never overwrites an input. One check for every command that writes
(runtime/outputs.py): an output may never be, or be inside, one of its inputs, nor inside a folder
shardtune rotates; two writers of one output never both "succeed"; two exports in one folder stay apart.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardtune.cli import main
from test_merge import _random_adapter

from tiny import make_model


@pytest.fixture(scope="module")
def base_and_adapter(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("inputs")
    make_model(root / "base", "llama")
    _random_adapter(root / "base", root / "run" / "adapter", {})
    return root / "base", root / "run" / "adapter"


def _tree(*folders: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for folder in folders for p in sorted(folder.rglob("*")) if p.is_file()}


def test_no_command_writes_into_or_over_its_inputs(base_and_adapter, capsys, no_workers):
    base, adapter = base_and_adapter
    before = _tree(base, adapter.parent)
    flags = ["--model", str(base), "--adapter", str(adapter)]
    refused = {
        # a GGUF over the trained adapter's weights, or over the base model's: --force does not make it right
        "export over the adapter": (["export", *flags, "--out", str(adapter / "adapter_model.safetensors"), "--force"],
                                    "is inside the adapter"),
        "export over the base": (["export", *flags, "--out", str(base / "model.safetensors"), "--force"],
                                 "is inside the model directory"),
        "merge into the base": (["merge", *flags, "--out", str(base / "merged")], "is inside the model directory"),
        "eval results into the adapter": (["eval", *flags, "--data", str(base / "config.json"), "--out",
                                           str(adapter / "eval.json")], "is inside the adapter"),
        "a fine-tune over its --init-adapter": (
            ["finetune", "--model", str(base), "--data", str(base / "config.json"), "--out", str(adapter.parent),
             "--overwrite", "--init-adapter", str(adapter)], f"is inside {adapter.parent / 'adapter'}, which the run"),
    }
    for name, (argv, words) in refused.items():
        assert main(argv) == 2, name
        err = capsys.readouterr().err
        assert words in err and "Traceback" not in err, (name, err)
    assert _tree(base, adapter.parent) == before
    assert not list(base.glob(".*")) and not list(adapter.glob(".*"))  # no lock or temporary left either


def test_no_output_inside_a_folder_shardtune_rotates(trained_run, tmp_path, capsys):
    checkpoint = trained_run / "checkpoints" / "step-3"
    before = _tree(trained_run)
    for out, words in ((checkpoint / "adapter", f"is inside the checkpoint {checkpoint}"),
                       (trained_run / "checkpoints" / "extracted",
                        f"is inside {trained_run / 'checkpoints'}, whose checkpoints shardtune rotates (--keep-last")):
        assert main(["adapter-from-checkpoint", str(checkpoint), str(out)]) == 2
        err = capsys.readouterr().err
        assert words in err, err
    assert _tree(trained_run) == before
    # beside the checkpoints, as docs/checkpoints.md shows, is fine
    assert main(["adapter-from-checkpoint", str(checkpoint), str(tmp_path / "adapter-step-3")]) == 0


def test_two_exports_into_one_folder_keep_their_own_modelfile(base_and_adapter, tmp_path, capsys):
    base, adapter = base_and_adapter
    for name, quant in (("a", "f16"), ("b", "q8_0")):
        assert main(["export", "--model", str(base), "--adapter", str(adapter), "--out", str(tmp_path / f"{name}.gguf"),
                     "--quant", quant]) == 0, capsys.readouterr().err
    assert (tmp_path / "a.Modelfile").read_text().startswith("FROM ./a.gguf\n")
    assert (tmp_path / "b.Modelfile").read_text().startswith("FROM ./b.gguf\n")
    assert not (tmp_path / "Modelfile").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.Modelfile", "a.gguf", "b.Modelfile", "b.gguf"]


def test_a_second_writer_of_the_same_output_is_refused(base_and_adapter, tmp_path, capsys):
    """What a concurrent merge or export holds: the output's writer lock (runtime/lock.py), the one
    finetune's --out takes too. A second writer is refused, naming the first; nothing of it is written."""
    import os

    from shardtune.runtime.outputs import claim_output

    base, adapter = base_and_adapter
    for kind, command, argv in (
            ("dir", "merge", ["merge", "--model", str(base), "--adapter", str(adapter), "--out", str(tmp_path / "m")]),
            ("file", "export", ["export", "--model", str(base), "--out", str(tmp_path / "m.gguf")])):
        out = Path(argv[argv.index("--out") + 1])
        with claim_output(out, kind=kind, command=command):
            assert main(argv) == 2
            err = capsys.readouterr().err
            assert f"{out} is in use by another run (process {os.getpid()} on" in err, err
            assert f"shardtune {command})" in err, err
        assert not out.exists()
        assert main(argv) == 0  # once the first has finished
    assert json.loads((tmp_path / "m" / "config.json").read_text())["model_type"] == "llama"
