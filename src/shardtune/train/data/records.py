"""The types a data source turns into: tokenized examples, a dataset of them, how a record of an objective
becomes examples, and the error for bad data."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from shardtune.errors import ShardtuneError

IGNORE = -100


class DataError(ShardtuneError, ValueError):
    """Bad training or validation data; the message names the file and line."""


@dataclass
class Example:
    input_ids: list[int]
    labels: list[int]  # IGNORE where the token is not a target

    @property
    def targets(self) -> int:
        # The model predicts token t+1 from t, so the first label never counts.
        return sum(1 for x in self.labels[1:] if x != IGNORE)


@dataclass
class Dataset:
    examples: Sequence[Example]  # a list, or TokenizedExamples when cached
    truncated: int  # records cut to --seq-len
    without_targets: int  # records with no target token left after truncation


@dataclass(frozen=True)
class RecordFormat:
    """What one record of an objective is, and how it becomes examples: an item of ``per_record``
    consecutive examples (SFT: one; a preference pair: its chosen then its rejected sequence), so that
    an item is never split over ranks or forwards."""

    name: str  # part of the token cache's key
    check: Callable[[object, str], None]  # (record, where) → raise DataError naming the field
    tokenize: Callable[..., tuple[list[Example], bool]]  # (tokenizer, record, seq_len) → examples, whether cut
    per_record: int  # examples per record


@dataclass(frozen=True)
class Lengths:
    """The training data's record lengths in tokens, after --seq-len: what the planner sizes a step by."""

    mean: float  # what packing fills rows with
    longest: int  # an unpacked micro-batch is padded to its longest record


def lengths_of(examples: Sequence[Example]) -> Lengths:
    offsets = getattr(examples, "offsets", None)  # TokenizedExamples: no Example objects needed
    if offsets is not None:
        sizes = offsets.diff()
        return Lengths(int(offsets[-1]) / max(1, len(examples)), int(sizes.max()) if len(sizes) else 0)
    sizes = [len(e.input_ids) for e in examples]
    return Lengths(sum(sizes) / max(1, len(sizes)), max(sizes, default=0))
