"""Rule: every refusal names its real cause (issue 35, class 5), through the command a user types.

Compressed data and data folders are read as ``datasets`` reads them; a lone surrogate, a GGUF cut short,
a LoRA pair of two ranks, a non-UTF-8 chat template, an --out in a missing folder and a --max-lora-rank
vLLM does not take are each named where they are, before anything is loaded or written. (lm-eval task
files: test_harness.py; a run folder given to adapter-from-checkpoint: test_provenance.py.)
"""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from shardtune.cli import main

from tiny import instruction_records, write_jsonl


def _eval(model: Path, data: Path, capsys) -> dict:
    assert main(["eval", "--model", str(model), "--data", str(data), "--max-new-tokens", "0", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_compressed_data_and_data_folders_are_read_as_datasets_reads_them(tiny_llama, train_jsonl, tmp_path,
                                                                          capsys):
    plain = _eval(tiny_llama, train_jsonl, capsys)
    gz = tmp_path / "train.jsonl.gz"
    gz.write_bytes(gzip.compress(train_jsonl.read_bytes()))
    assert _eval(tiny_llama, gz, capsys)["loss"] == plain["loss"]
    folder = tmp_path / "data"  # the split a file's name says: only the train files are trained on
    folder.mkdir()
    records = instruction_records(20)
    write_jsonl(folder / "train-00000-of-00002.jsonl", records[:12])
    (folder / "train-00001-of-00002.jsonl.gz").write_bytes(
        gzip.compress("".join(json.dumps(r) + "\n" for r in records[12:]).encode()))
    write_jsonl(folder / "test.jsonl", instruction_records(3, seed=1))
    result = _eval(tiny_llama, folder, capsys)
    assert result["records"] == 20 and result["loss"] == pytest.approx(plain["loss"], rel=1e-6)


def test_a_lone_surrogate_is_named_by_line_and_field(tiny_llama, tmp_path, capsys):
    data = tmp_path / "data.jsonl"
    data.write_text('{"instruction": "a", "output": "b"}\n{"instruction": "smile \\ud83d", "output": "x"}\n')
    assert main(["eval", "--model", str(tiny_llama), "--data", str(data), "--max-new-tokens", "0"]) == 2
    err = capsys.readouterr().err
    assert f"{data}:2: 'instruction' holds a lone surrogate \\ud83d" in err and "Traceback" not in err, err


def test_a_gguf_cut_short_is_said_so(tiny_llama, tmp_path, capsys):
    pytest.importorskip("gguf")
    whole = tmp_path / "m.gguf"
    assert main(["export", "--model", str(tiny_llama), "--out", str(whole)]) == 0
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole.read_bytes()[: whole.stat().st_size * 2 // 3])
    capsys.readouterr()
    assert main(["import-gguf", str(cut), str(tmp_path / "imported")]) == 2
    err = capsys.readouterr().err
    assert f"{cut} is cut short: its header places tensor" in err and f"the file has {cut.stat().st_size} bytes" \
        in err, err
    assert not (tmp_path / "imported").exists()


def test_lora_halves_of_two_ranks_are_named_before_any_matmul(trained_run, tiny_llama, tmp_path, capsys):
    adapter = shutil.copytree(trained_run / "adapter", tmp_path / "adapter")
    tensors = load_file(adapter / "adapter_model.safetensors")
    name = sorted(k for k in tensors if ".lora_B." in k)[0]
    rank = tensors[name].shape[1]
    tensors[name] = tensors[name][:, : rank // 2].clone()
    save_file(tensors, adapter / "adapter_model.safetensors", metadata={"format": "pt"})
    for argv in (["merge", "--model", str(tiny_llama), "--adapter", str(adapter), "--out", str(tmp_path / "m")],
                 ["export", "--model", str(tiny_llama), "--adapter", str(adapter), "--out", str(tmp_path / "m.gguf")],
                 ["export", "--adapter", str(adapter), "--check", "vllm"]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        module = name.removesuffix(".lora_B.weight")
        assert f"{module}: lora_A has rank {rank}" in err and f"lora_B has rank {rank // 2}" in err, err


def test_a_non_utf8_chat_template_is_named_by_export_and_finetune(tiny_llama, train_jsonl, tmp_path, capsys,
                                                                  no_workers):
    model = shutil.copytree(tiny_llama, tmp_path / "model")
    (model / "chat_template.jinja").write_bytes(b"{% for m in messages %}\xff{{ m.content }}{% endfor %}")
    expected = f"{model / 'chat_template.jinja'}:1: not valid UTF-8 (byte 0xff at column 24)"
    for argv in (["export", "--model", str(model), "--out", str(tmp_path / "m.gguf")],
                 ["finetune", "--model", str(model), "--data", str(train_jsonl), "--out", str(tmp_path / "run")]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert expected in err and "Traceback" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_export_into_a_missing_folder_is_refused_before_loading(tiny_llama, tmp_path, capsys, monkeypatch):
    import shardtune.tools.export as export

    monkeypatch.setattr(export, "check_model_dir", lambda *a: pytest.fail("the model was read first"))
    out = tmp_path / "nowhere" / "m.gguf"
    assert main(["export", "--model", str(tiny_llama), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"--out {out} cannot be created: its folder {out.parent} does not exist" in err, err


def test_max_lora_rank_that_vllm_does_not_take(trained_run, capsys):
    assert main(["export", "--adapter", str(trained_run / "adapter"), "--check", "vllm", "--max-lora-rank", "0"]) == 2
    err = capsys.readouterr().err
    assert "option --max-lora-rank 0: vLLM accepts only 1, 8, 16" in err and "--lora-r 0" not in err, err
