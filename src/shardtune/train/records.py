"""The types a data source turns into: tokenized examples, a dataset of them, and the error for bad data.

Apart from data.py (reading and tokenizing) so that datasets_io.py, which data.py uses, needs no
import of data.py back.
"""

from __future__ import annotations

from collections.abc import Sequence
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
