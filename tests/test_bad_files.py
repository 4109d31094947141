"""Rule: every file the CLI takes, when unreadable, gives exit code 2 and one message naming the file (and the
line or tensor), never a traceback, before any worker starts, and leaves --out untouched."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from shardtune.cli import main
from test_merge import _random_adapter

from tiny import instruction_records, make_model, write_jsonl

# Everything here must be refused before any worker starts.
pytestmark = pytest.mark.usefixtures("no_workers")


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("badfiles")
    make_model(root / "model", "llama")
    _random_adapter(root / "model", root / "adapter", {})
    write_jsonl(root / "train.jsonl", instruction_records(8))
    return root


def _fails(capsys, argv: list[str], *expected: str) -> str:
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("error: ") and "Traceback" not in err, err
    for text in expected:
        assert text in err, err
    return err


def _finetune(root: Path, tmp_path: Path, *, model: Path | None = None, data: Path | None = None,
              out: Path | None = None) -> list[str]:
    return ["finetune", "--model", str(model or root / "model"), "--data", str(data or root / "train.jsonl"),
            "--out", str(out or tmp_path / "out")]


def _copy_model(root: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(root / "model", tmp_path / "model"))


def test_truncated_model_weights_are_refused_by_finetune_and_plan(files, tmp_path, capsys):
    model = _copy_model(files, tmp_path)
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    _fails(capsys, _finetune(files, tmp_path, model=model), f"{weights} is truncated: tensor ")
    _fails(capsys, ["plan", "--model", str(model)], f"{weights} is truncated")
    weights.write_bytes(b"\x05")
    _fails(capsys, _finetune(files, tmp_path, model=model), f"{weights} is not a safetensors file, or is truncated")
    assert not (tmp_path / "out").exists()


def test_model_config_that_is_not_json(files, tmp_path, capsys):
    model = _copy_model(files, tmp_path)
    (model / "config.json").write_text('{\n  "model_type": "llama",\n  oops\n}')
    _fails(capsys, _finetune(files, tmp_path, model=model), f"{model / 'config.json'}:3: not valid JSON")
    _fails(capsys, _finetune(files, tmp_path, model=model / "config.json"), "is a file, not a directory")


def test_data_with_invalid_utf8_names_the_line(files, tmp_path, capsys):
    data = tmp_path / "train.jsonl"
    data.write_bytes(b'{"text": "a"}\n{"text": "b"}\n{"text": "caf\xe9"}\n')
    _fails(capsys, _finetune(files, tmp_path, data=data), f"{data}:3: not valid UTF-8 (byte 0xe9 at column 14)")


def test_data_path_that_is_a_folder_without_data_files(files, tmp_path, capsys):
    data = tmp_path / "data"  # beside --out: an --out inside an input folder is refused first (runtime/outputs.py)
    data.mkdir()
    (data / "notes.txt").write_text("not data")
    _fails(capsys, _finetune(files, tmp_path, data=data), f"{data} is a folder with no data files: expected .jsonl")


def test_out_that_is_a_file_or_read_only(files, tmp_path, capsys, monkeypatch):
    out = tmp_path / "out.txt"
    out.write_text("mine")
    _fails(capsys, _finetune(files, tmp_path, out=out), f"option 'out': {out} is a file, not a directory")
    assert out.read_text() == "mine"
    import shardtune.runtime.files as runtime_files

    # root writes anywhere: fake it
    monkeypatch.setattr(runtime_files.os, "access", lambda path, mode: not mode & runtime_files.os.W_OK)
    monkeypatch.setattr(runtime_files, "_read_only", lambda path: True)
    _fails(capsys, _finetune(files, tmp_path, out=tmp_path / "ro"), f"option 'out': {tmp_path / 'ro'} cannot be "
                                                                     "created")


def test_config_file_with_invalid_utf8_or_a_directory(tmp_path, capsys):
    config = tmp_path / "job.yaml"
    config.write_bytes(b"lora-r: 8\nmodel: \xff\n")
    _fails(capsys, ["finetune", "--config", str(config)], f"{config}:2: not valid UTF-8 (byte 0xff at column 8)")
    _fails(capsys, ["finetune", "--config", str(tmp_path)], "is a directory, not a file")


@pytest.mark.parametrize("damage", ["truncated-weights", "config-not-json", "no-weights"])
def test_eval_generate_and_merge_with_a_broken_adapter(files, tmp_path, capsys, damage):
    adapter = Path(shutil.copytree(files / "adapter", tmp_path / "adapter"))
    weights, config = adapter / "adapter_model.safetensors", adapter / "adapter_config.json"
    if damage == "truncated-weights":
        weights.write_bytes(weights.read_bytes()[:-64])
        expected = f"{weights} is truncated: tensor "
    elif damage == "config-not-json":
        config.write_text("{\n'r': 8}")
        expected = f"{config}:2: not valid JSON"
    else:
        weights.unlink()
        expected = f"adapter directory {adapter} has no adapter_model.safetensors"
    model = str(files / "model")
    _fails(capsys, ["eval", "--model", model, "--adapter", str(adapter), "--data", str(files / "train.jsonl")],
           expected)
    _fails(capsys, ["generate", "--model", model, "--adapter", str(adapter), "--prompt", "hi"], expected)
    _fails(capsys, ["merge", "--model", model, "--adapter", str(adapter), "--out", str(tmp_path / "m")], expected)
    assert not (tmp_path / "m").exists()


def test_prompts_and_eval_data_that_are_unreadable(files, tmp_path, capsys):
    bad = tmp_path / "p.txt"
    bad.write_bytes(b"fine\n\xc3\x28\n")
    _fails(capsys, ["generate", "--model", str(files / "model"), "--prompts", str(bad)], f"{bad}:2: not valid UTF-8")
    _fails(capsys, ["eval", "--model", str(files / "model"), "--data", str(tmp_path)], "is a folder with no data files")


def test_eval_and_generate_with_an_adapter_made_for_another_model(files, tmp_path, capsys):
    make_model(tmp_path / "gpt2", "gpt2")
    _random_adapter(tmp_path / "gpt2", tmp_path / "gpt2-adapter", {})
    adapter = tmp_path / "gpt2-adapter"
    _fails(capsys, ["generate", "--model", str(files / "model"), "--adapter", str(adapter), "--prompt", "hi"],
           f"adapter {adapter} does not fit the model {files / 'model'}")
    _fails(capsys, ["eval", "--model", str(files / "model"), "--adapter", str(adapter), "--data",
                    str(files / "train.jsonl"), "--max-new-tokens", "0"], "does not fit the model")


def test_a_model_whose_tokenizer_is_broken(files, tmp_path, capsys):
    model = _copy_model(files, tmp_path)
    (model / "tokenizer.json").write_text("{ not json")
    expected = f"model directory {model} has no usable tokenizer"
    _fails(capsys, ["generate", "--model", str(model), "--prompt", "hi"], expected)
    _fails(capsys, _finetune(files, tmp_path, model=model), expected)
