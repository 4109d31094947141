"""Rule: what would silently train or answer worse is said once, with its fix, and one rule holds for every
source and objective (issue 35, class 6).

(Options of another objective: test_preference_data.py; the demo model's chat template in a Modelfile:
test_export.py.)
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

import shardtune.launch
from shardtune.cli import main

from tiny import make_model, write_jsonl


@pytest.fixture
def launched(monkeypatch) -> list:
    """The runs that passed every check (their workers are not started)."""
    runs: list = []
    monkeypatch.setattr(shardtune.launch, "launch", lambda cfg, plan, asked=None: runs.append(cfg) or {})
    return runs


def _finetune(model: Path, data: Path, out: Path, *extra: str) -> int:
    return main(["finetune", "--model", str(model), "--data", str(data), "--out", str(out), "--batch-size", "2",
                 *extra])


def test_a_null_input_is_no_input_from_jsonl_csv_and_parquet_alike(tiny_llama, tmp_path, capsys):
    pytest.importorskip("datasets")
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"instruction": "Say hi", "input": None, "output": "hi"}, {"instruction": "Add", "input": "1 2",
                                                                       "output": "3"}]
    write_jsonl(tmp_path / "d.jsonl", rows)
    (tmp_path / "d.csv").write_text("instruction,input,output\nSay hi,,hi\nAdd,1 2,3\n")
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    losses = []
    for name in ("d.jsonl", "d.csv", "d.parquet"):
        assert main(["eval", "--model", str(tiny_llama), "--data", str(tmp_path / name), "--max-new-tokens", "0",
                     "--json"]) == 0, (name, capsys.readouterr().err)
        losses.append(json.loads(capsys.readouterr().out)["loss"])
    assert losses[0] == losses[1] == losses[2]


def test_a_json_key_given_twice_is_refused_by_line_and_key(tiny_llama, tmp_path, capsys, no_workers):
    data = tmp_path / "d.jsonl"
    data.write_text('{"instruction": "a", "output": "b"}\n{"instruction": "a", "output": "b", "output": "c"}\n')
    assert _finetune(tiny_llama, data, tmp_path / "out") == 2
    err = capsys.readouterr().err
    assert f"{data}:2: key 'output' is given twice" in err, err


def test_chat_data_without_a_chat_template_and_a_tokenizer_without_eos_are_warned(tmp_path, caplog, launched):
    model = make_model(tmp_path / "plain", "llama", chat_template=False)
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": None}))
    chat = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    data = write_jsonl(tmp_path / "chat.jsonl", [chat] * 4)
    caplog.set_level(logging.WARNING, logger="shardtune")
    assert _finetune(model, data, tmp_path / "out") == 0 and launched  # warnings: the run goes on
    assert f"{data}: 4 of 4 records are chat messages (record line 1, 2, 3, 4), but the tokenizer of {model} has no " \
           "chat template" in caplog.text
    assert f"the tokenizer of {model} has no EOS token" in caplog.text and "set eos_token" in caplog.text
    assert caplog.text.count("has no chat template") == 1  # once, not per record


def test_preference_pairs_get_the_sft_message_checks_and_a_mixed_file_is_warned(tiny_llama, tmp_path, caplog,
                                                                               launched):
    user, answer = {"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": "Paris."}
    wrong = {"role": "assistant", "content": "Lyon."}
    pairs = [{"prompt": [user], "chosen": [answer], "rejected": [wrong]},
             {"chosen": [user, answer], "rejected": [user, wrong]},  # no prompt: the shared start is it
             {"prompt": [{"role": "system", "content": "Be terse."}], "chosen": [answer], "rejected": [wrong]},
             {"prompt": [{"role": "wizard", "content": "hm"}, user], "chosen": [answer], "rejected": [wrong]}]
    data = write_jsonl(tmp_path / "pairs.jsonl", pairs)
    caplog.set_level(logging.WARNING, logger="shardtune")
    assert _finetune(tiny_llama, data, tmp_path / "out", "--objective", "dpo") == 0 and launched
    assert f"{data}: 3 pairs give a 'prompt' and 1 do not (record line 2" in caplog.text
    assert f"{data}: 1 of 4 conversations have no user turn (record line 3)" in caplog.text
    assert f"{data}: chat role 'wizard' is not one of system, user, assistant, tool (1 message, record line 4)" \
        in caplog.text


def test_a_generate_prompt_longer_than_the_context_is_refused(tiny_llama, capsys):
    context = json.loads((tiny_llama / "config.json").read_text())["max_position_embeddings"]
    assert main(["generate", "--model", str(tiny_llama), "--prompt", "x" * (context + 10)]) == 2
    err = capsys.readouterr().err
    assert "the prompt ('xxxx" in err and f"tokens, and the model's context is {context}" in err, err
