"""A data file's records → a tokenized Dataset of its objective's examples, through the token cache.

Every rank tokenizes the whole (small) file — or maps preflight's cache of it — so every rank knows
every record's target-token count: the loss normaliser of a global batch is known without communication.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from shardtune.train.data.cache import TokenizedExamples, cache_key, load_cached, save_cached
from shardtune.train.data.read import read_records
from shardtune.train.data.records import DataError, Dataset, Example, RecordFormat
from shardtune.train.data.sft import SFT
from shardtune.train.data.sources import location


def load_dataset(path: str | Path, tokenizer, seq_len: int, vocab_size: int | None = None, fields: str = "",
                 cache_dir: Path | None = None, fmt: RecordFormat = SFT, show_progress: bool = False) -> Dataset:
    """The tokenized records; with ``cache_dir`` tokenized once (preflight) and memory-mapped by every rank.

    With ``vocab_size``, every token id is checked against the model's embedding here, once, so that
    training never checks ids on the device (a host sync per lookup); a cache is only written after it.
    ``show_progress``: a "tokenizing FILE" bar and summary line (preflight: the one process that tokenizes).
    """
    key_fields = fields if fmt is SFT else f"{fields}|{fmt.name}"
    key = cache_key(path, tokenizer, seq_len, key_fields) if cache_dir is not None else None
    if key and (cached := load_cached(cache_dir, key)) is not None:
        return cached
    counts = {"truncated": 0, "empty": 0}

    from shardtune.runtime.progress import progress

    records = read_records(path, fields, fmt.check)
    bar = progress(f"tokenizing {Path(path).name}", len(records), unit="record", enabled=show_progress)

    def tokenized() -> Iterator[Example]:
        for lineno, record in records:
            try:
                examples, cut = fmt.tokenize(tokenizer, record, seq_len)
            except DataError as err:
                raise DataError(f"{location(path, lineno)}: {err}") from None
            for ex in examples:
                if vocab_size is not None and ex.input_ids and \
                        not 0 <= min(ex.input_ids) <= max(ex.input_ids) < vocab_size:
                    bad = next(i for i in ex.input_ids if not 0 <= i < vocab_size)
                    raise DataError(f"{location(path, lineno)}: token id {bad} is outside the model's {vocab_size} "
                                    f"embedding rows (does the tokenizer match the model?)")
            counts["truncated"] += cut
            bar.advance(tokens=sum(len(ex.input_ids) for ex in examples))
            if any(ex.targets == 0 for ex in examples):
                counts["empty"] += 1
                continue
            yield from examples

    # With a cache the records go straight into flat int32 arrays (~8 bytes a token), never into a
    # list of Python int lists (~70 bytes a token): a million records stay a few hundred MB.
    with bar:
        examples = list(tokenized()) if key is None else TokenizedExamples.build(tokenized())
    if not len(examples):
        raise DataError(f"{path}: no record has a target token within --seq-len {seq_len}")
    dataset = Dataset(examples, counts["truncated"], counts["empty"])
    if key is not None:
        save_cached(cache_dir, key, dataset)
    return dataset
