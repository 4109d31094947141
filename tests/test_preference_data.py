"""Preference data: the forms TRL documents tokenize alike, bad pairs are named, odd ones warned about."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardtune.train.data.pairs import PAIRS
from shardtune.train.data.records import IGNORE, DataError
from shardtune.train.data.tokenize import load_dataset

from tiny import make_model, make_tokenizer, write_jsonl


def _load(tmp_path: Path, records: list[dict], seq_len: int = 128, fields: str = "", chat: bool = True):
    path = write_jsonl(tmp_path / "pairs.jsonl", records)
    return load_dataset(path, make_tokenizer(chat), seq_len, fields=fields, fmt=PAIRS)


def _responses(example, tokenizer) -> str:
    return tokenizer.decode([i for i, lab in zip(example.input_ids, example.labels) if lab != IGNORE])


def test_conversational_and_implicit_prompt_pairs_tokenize_alike(tmp_path):
    user = {"role": "user", "content": "Capital of France?"}
    good, bad = {"role": "assistant", "content": "Paris."}, {"role": "assistant", "content": "Lyon, I think."}
    explicit = _load(tmp_path, [{"prompt": [user], "chosen": [good], "rejected": [bad]}])
    implicit = _load(tmp_path, [{"chosen": [user, good], "rejected": [user, bad]}])
    assert len(explicit.examples) == 2  # chosen, then rejected
    for a, b in zip(explicit.examples, implicit.examples):
        assert a.input_ids == b.input_ids and a.labels == b.labels
    tok = make_tokenizer()
    assert _responses(explicit.examples[0], tok) == "Paris.</s>"  # the template's end of turn is learned too
    assert _responses(explicit.examples[1], tok) == "Lyon, I think.</s>"
    prompt = tok.apply_chat_template([user], tokenize=False, add_generation_prompt=True)
    assert tok.decode(explicit.examples[0].input_ids).startswith(prompt)


def test_string_pairs_end_with_eos_and_mapped_columns_work(tmp_path):
    data = _load(tmp_path, [{"question": "2+2=", "good": "4", "bad": "5"}],
                 fields="prompt=question,chosen=good,rejected=bad", chat=False)
    tok = make_tokenizer(False)
    assert [_responses(e, tok) for e in data.examples] == ["4</s>", "5</s>"]
    implicit = _load(tmp_path, [{"chosen": "2+2= 4", "rejected": "2+2= 5"}], chat=False)
    assert [_responses(e, tok) for e in implicit.examples] == [" 4</s>", " 5</s>"]  # as TRL's extract_prompt


@pytest.mark.parametrize("record,message", [
    ({"prompt": "p", "chosen": "a"}, r"pairs.jsonl:1: no 'rejected' field"),
    ({"prompt": "p", "chosen": "  ", "rejected": "b"}, r"pairs.jsonl:1: 'chosen' is empty"),
    ({"prompt": "p", "chosen": "a", "rejected": []}, r"pairs.jsonl:1: 'rejected' must be a non-empty list"),
    ({"prompt": "p", "chosen": "a", "rejected": 3}, r"'rejected' must be a string or a list of messages"),
    ({"prompt": "p", "chosen": "a", "rejected": [{"role": "assistant", "content": "b"}]},
     r"must both be strings or both lists"),
    ({"chosen": "abc", "rejected": "xyz"}, r"share no beginning"),
    ({"instruction": "hi", "output": "there"}, r"this is an SFT record .*--objective sft"),
    ({"prompt": "x" * 200, "chosen": "a", "rejected": "b"}, r"pairs.jsonl:1: the prompt alone has 200 tokens and "
                                                            r"fills --seq-len 128"),
])
def test_bad_pairs_are_named_by_file_line_and_field(tmp_path, record, message):
    with pytest.raises(DataError, match=message):
        _load(tmp_path, [record], chat=False)


def _finetune(tmp_path: Path, records: list[dict], *args: str) -> tuple[int, str]:
    from shardtune.cli import main

    model = tmp_path / "model"
    if not model.exists():
        make_model(model)
    data = write_jsonl(tmp_path / "data.jsonl", records)
    return main(["finetune", "--model", str(model), "--data", str(data), "--out", str(tmp_path / "out"),
                 "--batch-size", "2", *args])


def test_preference_data_to_sft_and_sft_data_to_dpo_are_clear_errors(tmp_path, no_workers, capsys):
    assert _finetune(tmp_path, [{"prompt": "p", "chosen": "a", "rejected": "b"}]) == 2
    err = capsys.readouterr().err
    assert "data.jsonl:1: this is a preference pair" in err and "--objective dpo" in err and "Traceback" not in err
    assert _finetune(tmp_path, [{"instruction": "i", "output": "o"}], "--objective", "dpo") == 2
    err = capsys.readouterr().err
    assert "data.jsonl:1: this is an SFT record" in err and "'prompt', 'chosen' and 'rejected'" in err


def test_identical_and_cut_pairs_are_warned_about_with_counts(tmp_path, no_workers, caplog):
    records = [{"prompt": "p ", "chosen": "same", "rejected": "same"},
               {"prompt": "q ", "chosen": "x" * 60, "rejected": "y"}, {"prompt": "r ", "chosen": "a", "rejected": "b"}]
    with pytest.raises(AssertionError, match="workers would have been started"):
        import shardtune

        shardtune.finetune({"model": str(make_model(tmp_path / "model")), "data": str(write_jsonl(
            tmp_path / "d.jsonl", records)), "out": str(tmp_path / "o"), "objective": "dpo", "seq-len": 40,
            "batch-size": 2})
    text = caplog.text
    assert "1 of 3 pairs have the same chosen and rejected response (record 1)" in text
    assert "1 of 3 pairs are longer than --seq-len 40: their responses are cut at the end" in text


@pytest.mark.parametrize("flag,value,message", [
    ("--dpo-beta", "0", "option 'dpo-beta' must be greater than 0"),
    ("--dpo-label-smoothing", "0.5", r"option 'dpo-label-smoothing' must be in \[0, 0.5\)"),
    ("--orpo-lambda", "-1", "option 'orpo-lambda' must be at least 0"),
])
def test_objective_knobs_out_of_range_are_refused(tmp_path, no_workers, capsys, flag, value, message):
    import re

    code = _finetune(tmp_path, [{"prompt": "p", "chosen": "a", "rejected": "b"}], "--objective", "dpo", flag, value)
    assert code == 2 and re.search(message, capsys.readouterr().err)


@pytest.mark.parametrize("objective,option", [
    ("simpo", ["--precompute-reference"]), ("sft", ["--dpo-beta", "0.5"]), ("orpo", ["--simpo-gamma", "1"]),
    ("dpo", ["--orpo-lambda", "0.5"]), ("sft", ["--dpo-loss", "ipo"]),
])
def test_options_of_another_objective_are_refused(tmp_path, no_workers, capsys, objective, option):
    """One rule (config.OBJECTIVE_OPTIONS): an option the objective would ignore is refused, never dropped."""
    record = {"instruction": "p", "output": "a"} if objective == "sft" else {"prompt": "p", "chosen": "a",
                                                                              "rejected": "b"}
    code = _finetune(tmp_path, [record], "--objective", objective, *option)
    err = capsys.readouterr().err
    assert code == 2 and f"option '{option[0][2:]}' applies to --objective" in err and objective in err, err
