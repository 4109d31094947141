"""Records → tokens → the micro-batches each rank feeds, in a seeded order.

Three record forms (JSON Lines or one JSON array; Parquet, CSV, saved datasets, Hub datasets and
ShareGPT records through datasets_io.py):
  {"instruction", "input"?, "output"}   loss on the output only
  {"messages": [{"role", "content"}, …]} loss on assistant turns only
  {"text"}                              loss on every token
The tokenizer's chat template renders the first two when it has one; otherwise a plain
"### Instruction / ### Response" layout does.

Every rank tokenizes the whole (small) file, so every rank knows every record's target-token
count: the loss normaliser of a global batch is known without communication.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from shardtune.config import parse_fields
from shardtune.errors import read_text
from shardtune.runplan import BatchSplit
from shardtune.train.datasets_io import (
    TokenizedExamples,
    cache_key,
    is_datasets_source,
    load_cached,
    location,
    normalize,
    read_rows,
    save_cached,
)
from shardtune.train.records import IGNORE, DataError, Dataset, Example


def read_records(path: str | Path, fields: str = "", check: Callable[[object, str], None] | None = None
                 ) -> list[tuple[int, dict]]:
    """(line number, record) pairs from a .jsonl file or a JSON array file, or (record index, record)
    from a source the ``datasets`` library reads (datasets_io.py); ``fields``: the --data-fields mapping;
    ``check(record, where)``: the record form's check (default: the SFT forms)."""
    check = check or check_record
    if is_datasets_source(path):
        return _checked(read_rows(path), path, fields, check)
    path = Path(path)
    text = read_text(path, "data file", DataError)
    if not text.strip():
        raise DataError(f"{path}: the file is empty")
    records: list[tuple[int, object]] = []
    if text.lstrip().startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as err:
            raise DataError(f"{path}:{err.lineno}: not valid JSON: {err.msg}") from None
        records = [(i + 1, r) for i, r in enumerate(items)]  # record index stands in for the line
    else:
        for lineno, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                records.append((lineno, json.loads(line)))
            except json.JSONDecodeError as err:
                raise DataError(f"{path}:{lineno}: not valid JSON: {err.msg} (column {err.colno})") from None
    if not records:
        raise DataError(f"{path}: no records")
    return _checked(records, path, fields, check)


def _checked(records: list[tuple[int, object]], path: str | Path, fields: str,
             check: Callable[[object, str], None]) -> list[tuple[int, dict]]:
    mapping = parse_fields(fields)
    records = [(n, normalize(r, mapping, location(path, n))) for n, r in records]
    for lineno, record in records:
        check(record, location(path, lineno))
    return records  # type: ignore[return-value]


def check_record(record: object, where: str) -> None:
    """An SFT record: instruction, chat or text; ``where`` names the file and line in messages."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if "chosen" in record or "rejected" in record:
        raise DataError(f"{where}: this is a preference pair (fields: {', '.join(sorted(record))}); --objective sft "
                        f"expects 'instruction'+'output', 'messages' or 'text': train pairs with --objective dpo, "
                        f"orpo or simpo")
    if "messages" in record:
        msgs = record["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise DataError(f"{where}: 'messages' must be a non-empty list")
        for i, m in enumerate(msgs):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise DataError(f"{where}: messages[{i}] must be an object with string 'role' and 'content'")
        if not any(m["role"] == "assistant" for m in msgs):
            raise DataError(f"{where}: no message has role 'assistant', so nothing would be learned")
    elif "instruction" in record or "output" in record:
        for key in ("instruction", "output"):
            if not isinstance(record.get(key), str):
                raise DataError(f"{where}: '{key}' must be a string (instruction records need instruction and output)")
        if not isinstance(record.get("input", ""), str):
            raise DataError(f"{where}: 'input' must be a string")
    elif "text" in record:
        if not isinstance(record["text"], str):
            raise DataError(f"{where}: 'text' must be a string")
    else:
        keys = ", ".join(sorted(record)) or "none"
        raise DataError(
            f"{where}: no known fields (found: {keys}); expected 'instruction'+'output', 'messages' or 'text'"
        )


def as_messages(record: dict) -> list[dict] | None:
    """Instruction and chat records as chat messages; None for plain text."""
    if "messages" in record:
        return record["messages"]
    if "instruction" in record:
        prompt = record["instruction"] + (f"\n\n{record['input']}" if record.get("input") else "")
        return [{"role": "user", "content": prompt}, {"role": "assistant", "content": record["output"]}]
    return None


def render_prompt(tokenizer, messages: list[dict]) -> str:
    """The text that asks the model for the next assistant turn (also used for generation)."""
    if tokenizer.chat_template:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    text = "".join(_plain_turn(m) for m in messages)
    return text + "### Response:\n"


def render_conversation(tokenizer, messages: list[dict]) -> str:
    """The whole conversation as the model sees it in training (chat template, or the plain layout)."""
    if tokenizer.chat_template:
        return tokenizer.apply_chat_template(messages, tokenize=False)
    return "".join(_plain_turn(x) for x in messages)


def _plain_turn(m: dict) -> str:
    if m["role"] == "assistant":
        return f"### Response:\n{m['content']}\n\n"
    if m["role"] == "system":
        return f"{m['content']}\n\n"
    return f"### Instruction:\n{m['content']}\n\n"


def _segments(tokenizer, messages: list[dict]) -> list[tuple[str, bool]]:
    """The conversation as consecutive (text, is_target) pieces."""
    pieces: list[tuple[str, bool]] = []
    done = ""
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prompt = render_prompt(tokenizer, messages[:i])
        full = render_conversation(tokenizer, messages[: i + 1])
        if not (prompt.startswith(done) and full.startswith(prompt)):
            raise DataError("the chat template does not render conversations prefix by prefix")
        pieces += [(prompt[len(done):], False), (full[len(prompt):], True)]
        done = full
    return pieces


def _render(tokenizer, messages: list[dict]) -> list[tuple[str, bool]]:
    """``_segments``, with a chat template's refusal (a jinja error, say) as a DataError about the record."""
    return rendered(_segments, tokenizer, messages)


def rendered(render: Callable, tokenizer, *args):
    """``render(tokenizer, *args)``, with a chat template's refusal (a jinja error, say) as a DataError about
    the record that names the template's file."""
    from jinja2 import TemplateError

    try:
        return render(tokenizer, *args)
    except (ValueError, TypeError, KeyError, TemplateError) as err:
        if isinstance(err, DataError):
            raise
        where = f" (template line {err.lineno})" if getattr(err, "lineno", None) else ""
        raise DataError(f"the chat template in {_template_source(tokenizer)} fails on this record{where}: "
                        f"{type(err).__name__}: {err}; if every record fails, the template is at fault, "
                        f"not the data") from None


def _template_source(tokenizer) -> str:
    """The file the tokenizer's chat template came from (transformers reads the first that exists)."""
    folder = Path(getattr(tokenizer, "name_or_path", "") or ".")
    for name in ("chat_template.jinja", "chat_template.json", "tokenizer_config.json"):
        if (folder / name).is_file():
            return str(folder / name)
    return f"the tokenizer of {folder}"


def tokenize(tokenizer, record: dict, seq_len: int) -> tuple[Example, bool]:
    """One record as tokens and labels, cut to ``seq_len``; also whether it was cut."""
    messages = as_messages(record)
    if messages is None:
        ids = tokenizer(record["text"], add_special_tokens=True)["input_ids"]
        if tokenizer.eos_token_id is not None:
            ids = ids + [tokenizer.eos_token_id]
        labels = list(ids)
    else:
        ids, labels = [], []
        if tokenizer.bos_token_id is not None and not tokenizer.chat_template:
            ids, labels = [tokenizer.bos_token_id], [IGNORE]
        for text, is_target in _render(tokenizer, messages):
            piece = tokenizer(text, add_special_tokens=False)["input_ids"]
            ids += piece
            labels += piece if is_target else [IGNORE] * len(piece)
        if not tokenizer.chat_template and tokenizer.eos_token_id is not None:
            ids.append(tokenizer.eos_token_id)
            labels.append(tokenizer.eos_token_id)
    cut = len(ids) > seq_len
    return Example(ids[:seq_len], labels[:seq_len]), cut


def token_cache(cfg) -> Path:
    """Where tokenized data is kept: $SHARDTUNE_CACHE/tokenized (default ~/.cache/shardtune/tokenized).

    Not under --out: preflight writes it, and nothing may appear in --out before the run starts.
    Entries are keyed by content (cache_key), so runs share them safely.
    """
    root = os.environ.get("SHARDTUNE_CACHE") or Path.home() / ".cache" / "shardtune"
    return Path(root) / "tokenized"


@dataclass(frozen=True)
class RecordFormat:
    """What one record of an objective is, and how it becomes examples (SFT: one; a preference pair: its
    chosen then its rejected sequence, consecutive, so that a pair is never split)."""

    name: str  # part of the token cache's key
    check: Callable[[object, str], None]  # (record, where) → raise DataError naming the field
    tokenize: Callable[..., tuple[list[Example], bool]]  # (tokenizer, record, seq_len) → examples, whether cut
    per_record: int  # examples per record


def _tokenize_sft(tokenizer, record: dict, seq_len: int) -> tuple[list[Example], bool]:
    example, cut = tokenize(tokenizer, record, seq_len)
    return [example], cut


SFT = RecordFormat("sft", check_record, _tokenize_sft, 1)


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


@dataclass(frozen=True)
class Lengths:
    """The training data's record lengths in tokens, after --seq-len: what the planner sizes a step by."""

    mean: float  # what packing fills rows with
    longest: int  # an unpacked micro-batch is padded to its longest record


def lengths_of(examples: Sequence[Example]) -> Lengths:
    if isinstance(examples, TokenizedExamples):
        sizes = examples.offsets.diff()
        return Lengths(examples.ids.numel() / max(1, len(examples)), int(sizes.max()) if len(sizes) else 0)
    sizes = [len(e.input_ids) for e in examples]
    return Lengths(sum(sizes) / max(1, len(sizes)), max(sizes, default=0))


class Sampler:
    """An endless, seeded stream of global batches; each epoch is a fresh permutation.

    Batch ``step`` depends only on (seed, step), which is what makes resuming exact.
    """

    def __init__(self, dataset_size: int, plan: BatchSplit, seed: int) -> None:
        self.n, self.plan, self.seed = dataset_size, plan, seed
        self._perms: dict[int, list[int]] = {}

    def _perm(self, epoch: int) -> list[int]:
        if epoch not in self._perms:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perms = {epoch: torch.randperm(self.n, generator=g).tolist()}
        return self._perms[epoch]

    def global_batch(self, step: int) -> list[int]:
        start = step * self.plan.batch_size
        return [self._perm((start + i) // self.n)[(start + i) % self.n] for i in range(self.plan.batch_size)]

    def micro_batches(self, step: int, rank: int) -> list[list[int]]:
        """This rank's share of batch ``step``, as its accumulation micro-batches."""
        per_rank = self.plan.batch_size // self.plan.world_size
        mine = self.global_batch(step)[rank * per_rank:(rank + 1) * per_rank]
        m = self.plan.micro_batch_size
        return [mine[i:i + m] for i in range(0, per_rank, m)]


def pad_id(tokenizer) -> int:
    """Padding is always masked, so any id works: pad, else eos, else 0."""
    if tokenizer.pad_token_id is not None:
        return tokenizer.pad_token_id
    return tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0


def collate(examples: list[Example], pad_id: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Right-pad to the longest example; padding is masked and never a target."""
    width = max(len(e.input_ids) for e in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for i, e in enumerate(examples):
        n = len(e.input_ids)
        ids[i, :n] = torch.tensor(e.input_ids)
        labels[i, :n] = torch.tensor(e.labels)
        mask[i, :n] = 1
    return {"input_ids": ids.to(device), "labels": labels.to(device), "attention_mask": mask.to(device)}


def shard_indices(n: int, rank: int, world_size: int) -> Iterator[int]:
    """Validation records for this rank: every world_size-th, so all are seen exactly once."""
    return iter(range(rank, n, world_size))
