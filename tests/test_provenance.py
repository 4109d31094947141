"""Rule: an adapter meets only the base model it was trained on (issue 35, class 4; model/adapter_dir.py).

Every adapter shardtune writes records its base's fingerprint; every command where an adapter meets a
base (--init-adapter, merge, export, generate, eval) refuses another model, of the same shapes included,
warns where only the name or path differs, and notes an adapter that records none. ``eval`` of a QLoRA
run's adapter uses the NF4 base its run's config.yaml names.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import yaml
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from shardtune.cli import main
from shardtune.model.adapter_dir import BASE_KEY

from tiny import make_model


@pytest.fixture(scope="module")
def other_base(tmp_path_factory) -> Path:
    """tiny_llama's architecture, config and shapes, other weights: another training of the same model."""
    return make_model(tmp_path_factory.mktemp("other") / "llama-tied", "llama", tied=True, seed=1)


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_every_command_refuses_an_adapter_of_another_base(trained_run, other_base, train_jsonl, tmp_path, capsys,
                                                          no_workers):
    adapter, before = trained_run / "adapter", _snapshot(trained_run)
    base = ["--model", str(other_base), "--adapter", str(adapter)]
    commands = {
        "merge": ["merge", *base, "--out", str(tmp_path / "merged")],
        "export": ["export", *base, "--out", str(tmp_path / "m.gguf")],
        "generate": ["generate", *base, "--prompt", "hi"],
        "eval": ["eval", *base, "--data", str(train_jsonl), "--max-new-tokens", "0"],  # would write RUN/eval.json
        "--init-adapter": ["finetune", "--model", str(other_base), "--data", str(train_jsonl), "--out",
                           str(tmp_path / "run"), "--init-adapter", str(adapter)],
    }
    for name, argv in commands.items():
        assert main(argv) == 2, name
        err = capsys.readouterr().err
        assert f"adapter {adapter} was trained on another base model than --model {other_base}: its weights " \
               "differ" in err and "Traceback" not in err, (name, err)
    assert list(tmp_path.iterdir()) == []  # nothing written
    assert _snapshot(trained_run) == before  # eval wrote nothing into the run's folder


def test_the_same_model_elsewhere_is_a_warning_and_an_unrecorded_base_a_note(trained_run, tiny_llama, tmp_path,
                                                                               caplog):
    caplog.set_level(logging.WARNING, logger="shardtune")
    copy = shutil.copytree(tiny_llama, tmp_path / "copy")
    assert main(["merge", "--model", str(copy), "--adapter", str(trained_run / "adapter"), "--out",
                 str(tmp_path / "m1")]) == 0
    assert f"names {tiny_llama.resolve()} as its base, not --model {copy}" in caplog.text, caplog.text
    config = json.loads((copy / "config.json").read_text())  # the same weights, a longer context set by hand
    (copy / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 512}))
    assert main(["merge", "--model", str(copy), "--adapter", str(trained_run / "adapter"), "--out",
                 str(tmp_path / "m3")]) == 0
    assert "whose weights are those of --model" in caplog.text and "max_position_embeddings was 256, now 512" \
        in caplog.text, caplog.text
    peft_own = shutil.copytree(trained_run / "adapter", tmp_path / "peft")  # as peft saves it: no record
    tensors = load_file(peft_own / "adapter_model.safetensors")
    save_file(tensors, peft_own / "adapter_model.safetensors", metadata={"format": "pt"})
    assert main(["merge", "--model", str(tiny_llama), "--adapter", str(peft_own), "--out", str(tmp_path / "m2")]) == 0
    assert f"note: adapter {peft_own} does not record the base model it was trained on" in caplog.text


def test_adapter_from_checkpoint_records_the_base_and_names_a_run_folder(trained_run, other_base, tmp_path, capsys):
    assert main(["adapter-from-checkpoint", str(trained_run), str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err
    assert f"{trained_run} is a run folder, not a checkpoint: give one of its checkpoints (step-1, step-2, step-3)" \
        in err, err
    step = trained_run / "checkpoints" / "step-3"
    assert main(["adapter-from-checkpoint", str(step), str(tmp_path / "b"), "--model", str(other_base)]) == 2
    assert "is another base model than checkpoint" in capsys.readouterr().err
    assert main(["adapter-from-checkpoint", str(step), str(tmp_path / "a")]) == 0
    with safe_open(str(tmp_path / "a" / "adapter_model.safetensors"), "pt") as f, \
            safe_open(str(trained_run / "adapter" / "adapter_model.safetensors"), "pt") as g:
        assert json.loads(f.metadata()[BASE_KEY]) == json.loads(g.metadata()[BASE_KEY])  # the run's base


def test_eval_of_a_qlora_runs_adapter_uses_the_nf4_base_its_config_names(trained_run, tiny_llama, train_jsonl,
                                                                          tmp_path, capsys, caplog):
    pytest.importorskip("torchao")
    caplog.set_level(logging.WARNING, logger="shardtune")
    run = tmp_path / "qlora"
    shutil.copytree(trained_run / "adapter", run / "adapter")
    options = yaml.safe_load((trained_run / "config.yaml").read_text())
    (run / "config.yaml").write_text(yaml.safe_dump({**options, "quantize": "nf4"}))
    argv = ["eval", "--model", str(tiny_llama), "--adapter", str(run / "adapter"), "--data", str(train_jsonl),
            "--max-new-tokens", "0", "--json"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["quantize"] == "nf4"
    assert "--quantize auto: the fine-tune that wrote" in caplog.text and "NF4 base" in caplog.text
    caplog.clear()
    assert main([*argv, "--quantize", "none"]) == 0  # asked for: the unquantized base, no note
    assert json.loads(capsys.readouterr().out)["quantize"] == "none" and "--quantize auto" not in caplog.text
