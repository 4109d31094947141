"""Rule: what would train or merge silently wrong is refused, naming the file and tensor; caches never go stale.

An integer tensor in a float checkpoint, a weight whose shape config.json contradicts, a tokenizer
larger than the embedding, an index pointing tensors at the wrong shard: exit 2 before any worker
starts. Data edited in place with the same size and mtime is tokenized again; a damaged token-cache
entry is rebuilt with a warning.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from shardtune.cli import main

from tiny import instruction_records, make_model, write_jsonl


def _finetune(capsys, model: Path, data: Path, out: Path) -> tuple[int, str]:
    code = main(["finetune", "--model", str(model), "--data", str(data), "--out", str(out), "--steps", "1",
                 "--batch-size", "4", "--strategy", "single", "--dtype", "fp32"])
    return code, capsys.readouterr().err


@pytest.fixture
def model(tmp_path) -> Path:
    return make_model(tmp_path / "model", "llama")


@pytest.fixture
def data(tmp_path) -> Path:
    return write_jsonl(tmp_path / "d.jsonl", instruction_records(8))


def _rewrite(model: Path, change) -> None:
    tensors = load_file(model / "model.safetensors")
    change(tensors)
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.usefixtures("no_workers")
def test_an_integer_tensor_in_a_float_checkpoint_is_refused_by_name(capsys, model, data, tmp_path):
    name = "model.layers.0.mlp.up_proj.weight"
    _rewrite(model, lambda t: t.__setitem__(name, t[name].to(torch.int8)))
    code, err = _finetune(capsys, model, data, tmp_path / "out")
    assert code == 2 and f"tensor {name} is stored as I8 (integers)" in err, err


@pytest.mark.usefixtures("no_workers")
def test_weights_that_contradict_config_json_are_refused_before_workers(capsys, model, data, tmp_path):
    name = "model.layers.1.self_attn.o_proj.weight"
    _rewrite(model, lambda t: t.__setitem__(name, t[name][:, :16].contiguous()))
    code, err = _finetune(capsys, model, data, tmp_path / "out")
    assert code == 2 and f"tensor {name} has shape [32, 16], but config.json gives [32, 32]" in err, err
    _rewrite(model, lambda t: t.pop(name))
    code, err = _finetune(capsys, model, data, tmp_path / "out")
    assert code == 2 and "the checkpoint has no tensor for 1 parameter(s)" in err and name in err, err


@pytest.mark.usefixtures("no_workers")
def test_a_tokenizer_larger_than_the_embedding_is_refused(capsys, model, data, tmp_path):
    config = json.loads((model / "config.json").read_text())
    config["vocab_size"] = 200  # the byte tokenizer has 259 tokens
    (model / "config.json").write_text(json.dumps(config))
    code, err = _finetune(capsys, model, data, tmp_path / "out")
    assert code == 2 and "the tokenizer has 259 tokens but config.json's vocab_size is 200" in err, err


@pytest.mark.usefixtures("no_workers")
def test_config_json_transformers_refuses_names_the_file(capsys, model, data, tmp_path):
    config = json.loads((model / "config.json").read_text())
    config["num_attention_heads"] = 5  # hidden 32 is not divisible by 5 heads
    (model / "config.json").write_text(json.dumps(config))
    code, err = _finetune(capsys, model, data, tmp_path / "out")
    assert code == 2 and str(model / "config.json") in err and "Traceback" not in err, err


def test_merge_with_an_index_pointing_at_the_wrong_shard_lists_the_tensors(capsys, tmp_path):
    model = make_model(tmp_path / "sharded", "llama", sharded=True)
    index_file = model / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    files = sorted(set(index["weight_map"].values()))
    moved = sorted(n for n, f in index["weight_map"].items() if f == files[-1])
    for name in moved:
        index["weight_map"][name] = files[0]
    index_file.write_text(json.dumps(index))
    code = main(["merge", "--model", str(model), "--adapter", str(tmp_path / "none"), "--out", str(tmp_path / "m")])
    err = capsys.readouterr().err
    assert code == 2 and f"places {len(moved)} tensor(s) in files that do not hold them" in err, err
    assert f"{moved[0]} (not in {files[0]})" in err and not (tmp_path / "m").exists()


def test_data_edited_with_same_size_and_mtime_is_tokenized_again(tmp_path):
    from shardtune.train.data.tokenize import load_dataset

    from tiny import make_tokenizer

    tok = make_tokenizer()
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": "aaaa bbbb"}])
    cache = tmp_path / "cache"
    first = load_dataset(data, tok, 64, None, "", cache)
    st = os.stat(data)
    data.write_text(data.read_text().replace("aaaa", "zzzz"))  # same size
    os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns))  # same mtime
    second = load_dataset(data, tok, 64, None, "", cache)
    assert list(first.examples[0].input_ids) != list(second.examples[0].input_ids)


def test_a_damaged_token_cache_entry_is_rebuilt_with_a_warning(capsys, caplog, tmp_path, monkeypatch, model, data):
    import shardtune.launch

    monkeypatch.setenv("SHARDTUNE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(shardtune.launch, "launch", lambda cfg, plan, asked=None: {})
    assert _finetune(capsys, model, data, tmp_path / "a")[0] == 0
    entry = next((tmp_path / "cache" / "tokenized").glob("tokens-*.pt"))
    entry.write_bytes(entry.read_bytes()[:100])  # truncated
    code, err = _finetune(capsys, model, data, tmp_path / "b")
    assert code == 0, err
    assert f"the token cache entry {entry} is unreadable" in caplog.text and "tokenizing the data again" in caplog.text
    assert entry.stat().st_size > 100  # written again
