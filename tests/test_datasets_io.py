"""--data through `datasets` (saved dirs, Parquet, CSV, cached Hub names), --data-fields and ShareGPT records."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardtune.config import ConfigError, build_config, validate
from shardtune.train.data.read import read_records
from shardtune.train.data.records import DataError
from shardtune.train.data.tokenize import load_dataset

from tiny import instruction_records, make_tokenizer, write_jsonl


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


def _qa(n: int = 6) -> list[dict]:
    return [{"question": r["instruction"], "answer": r["output"], "id": i}
            for i, r in enumerate(instruction_records(n))]


def test_saved_parquet_csv_and_jsonl_give_the_same_examples(tmp_path: Path, tok) -> None:
    import datasets

    records = instruction_records(6)
    reference = load_dataset(write_jsonl(tmp_path / "d.jsonl", records), tok, 128)
    ds = datasets.Dataset.from_list(records)
    ds.save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": ds}).save_to_disk(str(tmp_path / "saved_dict"))
    ds.to_parquet(str(tmp_path / "d.parquet"))
    ds.to_csv(str(tmp_path / "d.csv"), index=False)
    for source in ("saved", "saved_dict", "d.parquet", "d.csv"):
        got = load_dataset(tmp_path / source, tok, 128)
        assert [e.input_ids for e in got.examples] == [e.input_ids for e in reference.examples], source
        assert [e.labels for e in got.examples] == [e.labels for e in reference.examples], source


def test_data_fields_map_other_column_names(tmp_path: Path, tok) -> None:
    import datasets

    datasets.Dataset.from_list(_qa()).to_parquet(str(tmp_path / "qa.parquet"))
    mapped = load_dataset(tmp_path / "qa.parquet", tok, 128, fields="prompt=question,response=answer")
    reference = load_dataset(write_jsonl(tmp_path / "d.jsonl", instruction_records(6)), tok, 128)
    assert [e.labels for e in mapped.examples] == [e.labels for e in reference.examples]
    with pytest.raises(DataError, match=r"qa.parquet, record 1: no column 'reply' \(from --data-fields\)"):
        load_dataset(tmp_path / "qa.parquet", tok, 128, fields="prompt=question,response=reply")
    with pytest.raises(ConfigError, match="data-fields.*'answer' is not FIELD=COLUMN"):
        validate(build_config({"model": "m", "data": "d", "out": "o", "data-fields": "answer"}))


def test_sharegpt_records_train_on_assistant_turns_only(tmp_path: Path, tok) -> None:
    share = [{"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi?"},
                                {"from": "gpt", "value": "Hello."}]}]
    chat = [{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"},
                          {"role": "assistant", "content": "Hello."}]}]
    a = load_dataset(write_jsonl(tmp_path / "share.jsonl", share), tok, 128)
    b = load_dataset(write_jsonl(tmp_path / "chat.jsonl", chat), tok, 128)
    assert a.examples[0].labels == b.examples[0].labels and a.examples[0].targets < len(a.examples[0].input_ids)
    bad = [share[0], {"conversations": [{"from": "robot", "value": "x"}]}]
    with pytest.raises(DataError, match=r"bad.jsonl:2: conversations\[0\].from is 'robot'"):
        read_records(write_jsonl(tmp_path / "bad.jsonl", bad))


def test_bad_record_in_a_parquet_file_names_file_record_and_field(tmp_path: Path, tok) -> None:
    import datasets

    rows = [{"instruction": "a", "output": "b"}, {"instruction": "c", "output": None}]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "bad.parquet"))
    with pytest.raises(DataError, match=r"bad.parquet, record 2: 'output' must be a string"):
        load_dataset(tmp_path / "bad.parquet", tok, 128)


def test_hub_dataset_name_not_in_cache_is_a_clear_error(tmp_path: Path, tok, monkeypatch) -> None:
    import huggingface_hub.constants as constants

    from shardtune.model.hub import HubDatasetError

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")  # datasets' own switch is honoured as well as HF_HUB_OFFLINE
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(HubDatasetError, match="dataset 'nobody/none': there is no local file or directory "
                                              "nobody/none .*not in the local Hugging Face cache.*HF_DATASETS_OFFLINE"):
        load_dataset("nobody/none", tok, 128)


def test_tokenized_once_then_memory_mapped(tmp_path: Path, tok) -> None:
    from shardtune.train.data.cache import TokenizedExamples

    data = write_jsonl(tmp_path / "d.jsonl", instruction_records(9))
    plain = load_dataset(data, tok, 100)
    first = load_dataset(data, tok, 100, cache_dir=tmp_path / "cache")
    assert len(list((tmp_path / "cache").glob("tokens-*.pt"))) == 1
    second = load_dataset(data, tok, 100, cache_dir=tmp_path / "cache")
    assert isinstance(second.examples, TokenizedExamples)
    for got in (first, second):
        assert len(got.examples) == len(plain.examples) and got.truncated == plain.truncated
        assert [e.input_ids for e in got.examples] == [e.input_ids for e in plain.examples]
        assert [e.labels for e in got.examples[2:5]] == [e.labels for e in plain.examples[2:5]]
    write_jsonl(data, instruction_records(4))  # changed data: a new key, never stale tokens
    assert len(load_dataset(data, tok, 100, cache_dir=tmp_path / "cache").examples) == 4
    assert len(load_dataset(data, tok, 128, cache_dir=tmp_path / "cache").examples) == 4
    assert len(list((tmp_path / "cache").glob("tokens-*.pt"))) == 3
