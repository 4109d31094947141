"""Bad input stops `shardtune finetune` in the launching process with exit code 2 and one clear message.

Every case here fails in preflight, so no worker process is ever started; ``launch`` is replaced by a
function that fails the test if it is reached, and the output directory must stay untouched.
"""

from __future__ import annotations

import json
import shutil

import pytest

import shardtune.launch
from shardtune.cli import main
from shardtune.config import build_config
from shardtune.preflight import preflight

from tiny import write_jsonl

# Everything here must be refused before any worker starts.
pytestmark = pytest.mark.usefixtures("no_workers")


@pytest.fixture
def model_dir(tiny_llama):
    return tiny_llama


@pytest.fixture
def data(train_jsonl):
    return train_jsonl


def run(capsys, tmp_path, model, data, *extra: str) -> str:
    out = tmp_path / "out"
    code = main(["finetune", "--model", str(model), "--data", str(data), "--out", str(out), *extra])
    err = capsys.readouterr().err
    assert code == 2, err
    # progress summaries of the steps that finished may come first; the error is one paragraph, last
    assert err.startswith("error: ") or "\nerror: " in err
    err = err[err.index("error: "):]
    assert not out.exists() or not any(out.iterdir()), "preflight failed but something was written to --out"
    assert "Traceback" not in err
    return err


def test_valid_tiny_config_passes_preflight(monkeypatch, model_dir, data, tmp_path):
    """Good input passes, and only after preflight has read both data files and built the LoRA model
    (what the bad-input cases below rely on to fail early)."""
    import shardtune.preflight as pre

    read, built = [], []
    read_split, inject_lora = pre.read_split, pre.inject_lora
    monkeypatch.setattr(pre, "read_split",
                        lambda cfg, path, *a, **k: read.append(path) or read_split(cfg, path, *a, **k))

    def spy_inject_lora(*a):
        result = inject_lora(*a)
        built.append(result[0])
        return result

    monkeypatch.setattr(pre, "inject_lora", spy_inject_lora)
    cfg = build_config({"model": str(model_dir), "data": str(data), "val-data": str(data), "out": str(tmp_path / "o"),
                        "batch-size": 4, "nproc": 2, "lora-targets": "q_proj,v_proj", "seq-len": 64})
    preflight(cfg)
    assert read == [str(data), str(data)]
    lora = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n, p in built[0].named_parameters() if p.requires_grad}
    assert lora == {"q_proj", "v_proj"} and all(p.is_meta for p in built[0].parameters())
    assert not (tmp_path / "o").exists()  # preflight only reads


def test_valid_input_reaches_launch_and_out_is_not_made_before(monkeypatch, model_dir, data, tmp_path):
    """The guard above works: good input gets past preflight to launch, with --out still absent."""
    out = tmp_path / "out"
    seen = []

    def launch(cfg, plan, asked=None):
        seen.append((cfg.output.out, out.exists()))
        return {}

    monkeypatch.setattr(shardtune.launch, "launch", launch)
    assert main(["finetune", "--model", str(model_dir), "--data", str(data), "--out", str(out)]) == 0
    assert seen == [(str(out), False)]


def test_malformed_json_line(capsys, tmp_path, model_dir):
    path = tmp_path / "file.jsonl"
    path.write_text('{"text": "a"}\n{"text": "b"}\n{"text": "c"\n{"text": "d"}\n')
    err = run(capsys, tmp_path, model_dir, path)
    assert "file.jsonl:3" in err and "not valid JSON" in err


def test_malformed_json_array(capsys, tmp_path, model_dir):
    path = tmp_path / "file.json"
    path.write_text('[\n {"text": "a"},\n {"text": "b"}\n {"text": "c"}\n]\n')
    err = run(capsys, tmp_path, model_dir, path)
    assert "file.json:4" in err and "not valid JSON" in err


def test_record_with_no_known_fields(capsys, tmp_path, model_dir):
    path = write_jsonl(tmp_path / "file.jsonl", [{"text": "ok"}, {"prompt": "p", "completion": "c"}])
    err = run(capsys, tmp_path, model_dir, path)
    assert "file.jsonl:2" in err
    assert "no known fields" in err and "completion, prompt" in err
    assert "'instruction'" in err and "'messages'" in err and "'text'" in err


@pytest.mark.parametrize("content", ["", "\n  \n"])
def test_empty_data_file(capsys, tmp_path, model_dir, content):
    path = tmp_path / "empty.jsonl"
    path.write_text(content)
    err = run(capsys, tmp_path, model_dir, path)
    assert "empty.jsonl" in err and "empty" in err.split("empty.jsonl", 1)[1]


def test_missing_data_file(capsys, tmp_path, model_dir):
    err = run(capsys, tmp_path, model_dir, tmp_path / "nowhere.jsonl")
    assert "nowhere.jsonl" in err and "does not exist" in err


def test_missing_validation_file(capsys, tmp_path, model_dir, data):
    err = run(capsys, tmp_path, model_dir, data, "--val-data", str(tmp_path / "val.jsonl"))
    assert "val.jsonl" in err and "does not exist" in err


def test_missing_model_dir(capsys, tmp_path, data):
    err = run(capsys, tmp_path, tmp_path / "no-model", data)
    assert "no-model" in err and "does not exist" in err


def test_model_dir_without_config(capsys, tmp_path, model_dir, data):
    broken = tmp_path / "broken"
    shutil.copytree(model_dir, broken)
    (broken / "config.json").unlink()
    err = run(capsys, tmp_path, broken, data)
    assert str(broken) in err and "no config.json" in err


def test_model_dir_without_weights(capsys, tmp_path, model_dir, data):
    broken = tmp_path / "broken"
    shutil.copytree(model_dir, broken)
    (broken / "model.safetensors").unlink()
    (broken / "pytorch_model.bin").write_bytes(b"")
    err = run(capsys, tmp_path, broken, data)
    assert str(broken) in err and "no model.safetensors" in err
    assert "pytorch_model.bin" in err  # what it found instead


def test_sharded_index_naming_missing_files(capsys, tmp_path, model_dir, data):
    broken = tmp_path / "broken"
    shutil.copytree(model_dir, broken)
    (broken / "model.safetensors").unlink()
    index = {"metadata": {}, "weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}
    (broken / "model.safetensors.index.json").write_text(json.dumps(index))
    err = run(capsys, tmp_path, broken, data)
    assert "model-00002-of-00002.safetensors" in err and "missing" in err


def test_model_dir_without_tokenizer(capsys, tmp_path, model_dir, data):
    broken = tmp_path / "broken"
    shutil.copytree(model_dir, broken)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        (broken / name).unlink(missing_ok=True)
    err = run(capsys, tmp_path, broken, data)
    assert str(broken) in err and "tokenizer" in err


def test_lora_targets_the_model_does_not_have(capsys, tmp_path, model_dir, data):
    err = run(capsys, tmp_path, model_dir, data, "--lora-targets", "q_proj,c_attn")
    assert "lora-targets" in err and "c_attn" in err
    for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
        assert name in err  # the linear modules it has


def test_modules_to_save_the_model_does_not_have(capsys, tmp_path, model_dir, data):
    err = run(capsys, tmp_path, model_dir, data, "--lora-modules-to-save", "score")
    assert "lora-modules-to-save" in err and "score" in err


def test_unknown_key_in_config_file(capsys, tmp_path, model_dir, data):
    config = tmp_path / "run.yaml"
    config.write_text("lora_rank: 16\n")
    err = run(capsys, tmp_path, model_dir, data, "--config", str(config))
    assert str(config) in err and "'lora_rank'" in err and "did you mean 'lora-r'" in err


def test_bad_value_in_config_file(capsys, tmp_path, model_dir, data):
    config = tmp_path / "run.yaml"
    config.write_text("strategy: zero3\n")
    err = run(capsys, tmp_path, model_dir, data, "--config", str(config))
    assert "option 'strategy'" in err and "zero3" in err


def test_missing_config_file(capsys, tmp_path, model_dir, data):
    err = run(capsys, tmp_path, model_dir, data, "--config", str(tmp_path / "none.yaml"))
    assert "none.yaml" in err and "does not exist" in err


def test_batch_size_not_divisible_by_ranks(capsys, tmp_path, model_dir, data):
    err = run(capsys, tmp_path, model_dir, data, "--batch-size", "3", "--nproc", "2")
    assert "--batch-size 3" in err and "2 ranks" in err


def test_micro_batch_size_not_dividing(capsys, tmp_path, model_dir, data):
    err = run(capsys, tmp_path, model_dir, data, "--batch-size", "8", "--micro-batch-size", "3", "--nproc", "2")
    assert "micro-batches of 3 on 2 ranks" in err


def test_missing_required_option(capsys, tmp_path, data):
    out = tmp_path / "out"
    assert main(["finetune", "--data", str(data), "--out", str(out)]) == 2
    assert "option 'model' is required" in capsys.readouterr().err
    assert not out.exists()


def test_seq_len_too_short_for_any_target(capsys, tmp_path, model_dir):
    path = write_jsonl(tmp_path / "d.jsonl", [{"instruction": "x" * 100, "output": "y"}])
    err = run(capsys, tmp_path, model_dir, path, "--seq-len", "16")
    assert "d.jsonl" in err and "--seq-len 16" in err


def test_existing_out_dir_is_left_untouched(capsys, tmp_path, model_dir):
    out = tmp_path / "out"
    out.mkdir()
    (out / "summary.json").write_text("{}")
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    # --overwrite too deletes nothing before the run is accepted
    assert main(["finetune", "--model", str(model_dir), "--data", str(bad), "--out", str(out), "--overwrite"]) == 2
    assert "bad.jsonl:1" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["summary.json"]
