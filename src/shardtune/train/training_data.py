"""The training data as every entry point reads it: the same tokenizer, --seq-len, fields, token
cache and record format (the objective's), so ``shardtune plan`` sizes a step by the rows ``finetune``
will run."""

from __future__ import annotations

from shardtune.config import Config
from shardtune.model.directory import ModelDir, check_model_dir, load_tokenizer
from shardtune.model.meta import vocab_size
from shardtune.train.data.cache import token_cache
from shardtune.train.data.records import Dataset, Lengths, lengths_of
from shardtune.train.data.tokenize import load_dataset
from shardtune.train.objectives import objective_of


def read_split(cfg: Config, path: str, tokenizer, vocab: int | None, show_progress: bool = False) -> Dataset:
    """One data file (or directory, or Hub id) of this run, tokenized, through the shared cache."""
    return load_dataset(path, tokenizer, cfg.data.seq_len, vocab, cfg.data.fields, token_cache(cfg),
                        objective_of(cfg).records, show_progress=show_progress)


def training_lengths(cfg: Config, model_dir: ModelDir | None = None) -> Lengths | None:
    """The training records' lengths, or None when no training data is given."""
    if not cfg.data.train:
        return None
    model_dir = model_dir or check_model_dir(cfg.model.path, cfg.model.trust_remote_code)
    return lengths_of(read_split(cfg, cfg.data.train, load_tokenizer(model_dir), vocab_size(model_dir)).examples)
