"""Rule: data that will not do what the user thinks is named before the run, with numbers and record lines."""

from __future__ import annotations

import logging

import pytest

import shardtune.launch
from shardtune.cli import main
from shardtune.train.data.checks import data_warnings

from tiny import instruction_records, make_model, write_jsonl


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("warn") / "tiny", arch="llama")


def test_one_record_with_batch_8_and_an_unknown_role_are_named_before_launch(model_dir, tmp_path, caplog,
                                                                              monkeypatch):
    launched = []
    monkeypatch.setattr(shardtune.launch, "launch", lambda cfg, plan, asked=None: launched.append(cfg) or {})
    chat = {"messages": [{"role": "wizard", "content": "abracadabra"}, {"role": "assistant", "content": "poof"}]}
    data = write_jsonl(tmp_path / "one.jsonl", [chat])
    caplog.set_level(logging.WARNING, logger="shardtune")
    assert main(["finetune", "--model", str(model_dir), "--data", str(data), "--out", str(tmp_path / "o"),
                 "--batch-size", "8"]) == 0
    assert launched  # warnings, not errors: the run goes on
    assert f"{data}: only 1 usable record for --batch-size 8: every optimizer step repeats records " \
           "(each about 8.0 times)" in caplog.text
    assert f"{data}: chat role 'wizard' is not one of system, user, assistant, tool (1 message, record line 1)" \
        in caplog.text


def test_no_warning_for_ordinary_data():
    records = list(enumerate(instruction_records(8), start=1))
    records.append((9, {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                                     {"role": "assistant", "content": "a"}]}))
    assert data_warnings("d.jsonl", records, usable=9, batch_size=8) == []
    many = [(n, {"messages": [{"role": "bot", "content": "x"}]}) for n in range(1, 8)]
    role, no_user = data_warnings("d.jsonl", many, usable=7, batch_size=4)
    assert "chat role 'bot'" in role and "7 messages, record line 1, 2, 3, 4, 5, …" in role
    assert "7 of 7 conversations have no user turn (record line 1, 2, 3, 4, 5, …)" in no_user
