"""Preference pairs: a prompt, a chosen and a rejected response, in the forms TRL documents.

  {"prompt": str, "chosen": str, "rejected": str}                          standard
  {"prompt": [messages], "chosen": [assistant messages], "rejected": [...]} conversational
  {"chosen": [messages], "rejected": [messages]}                           implicit prompt: the shared start
  (also with strings: the common prefix of chosen and rejected is the prompt, as TRL's extract_prompt)

A pair becomes two examples, chosen then rejected, each the prompt followed by its response; only the
response tokens are targets. Tokenized as TRL's DPOTrainer does: the prompt and each prompt + response are
tokenized whole, and the response starts where the two token sequences first differ (a token that merges
across the boundary belongs to the response). Plain strings get the tokenizer's EOS after the response;
chat templates end turns themselves. Too long: the response's end is cut (the prompt stays whole, as
TRL's default ``keep_start``), since a response without its prompt teaches nothing; a prompt that alone
fills ``--seq-len`` is an error, as no response token would be left.
"""

from __future__ import annotations

from shardtune.train.data.chat import check_messages, render_conversation, render_prompt, rendered
from shardtune.train.data.records import IGNORE, DataError, Example, RecordFormat

EXPECTED = "a preference pair needs 'chosen' and 'rejected' (and 'prompt', unless chosen and rejected are " \
           "whole conversations that share it)"


def _prompt_of(record: dict) -> object:
    # --data-fields prompt=COLUMN maps onto "instruction" (the SFT name): a pair accepts either.
    return record.get("prompt", record.get("instruction"))


def check_pair(record: object, where: str) -> None:
    """Raise DataError naming the record and field when ``record`` is no usable preference pair."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
    missing = [k for k in ("chosen", "rejected") if k not in record]
    if missing:
        sft = [k for k in ("instruction", "output", "messages", "text", "conversations") if k in record]
        if sft and "chosen" not in record:
            raise DataError(f"{where}: this is an SFT record (fields: {', '.join(sorted(record))}); preference "
                            f"objectives expect 'prompt', 'chosen' and 'rejected': train it with --objective sft")
        raise DataError(f"{where}: no '{missing[0]}' field (found: {', '.join(sorted(record)) or 'none'}); "
                        f"{EXPECTED}")
    prompt, chosen, rejected = _prompt_of(record), record["chosen"], record["rejected"]
    for key, value in (("chosen", chosen), ("rejected", rejected)):
        if isinstance(value, str):
            if not value.strip():
                raise DataError(f"{where}: '{key}' is empty")
        elif isinstance(value, list):
            check_messages(value, key, where)
            if not any(m["content"].strip() for m in value):
                raise DataError(f"{where}: '{key}' is empty (no message has content)")
        else:
            raise DataError(f"{where}: '{key}' must be a string or a list of messages, got {type(value).__name__}")
    if type(chosen) is not type(rejected):
        raise DataError(f"{where}: 'chosen' and 'rejected' must both be strings or both lists of messages")
    if prompt is None:
        if _shared_prefix(chosen, rejected) == 0:
            raise DataError(f"{where}: no 'prompt', and 'chosen' and 'rejected' share no beginning to take as it; "
                            f"{EXPECTED}")
        return
    if isinstance(chosen, str) != isinstance(prompt, str):
        raise DataError(f"{where}: 'prompt' and the responses must both be strings or both lists of messages")
    if isinstance(prompt, list):
        check_messages(prompt, "prompt", where)
        for key, value in (("chosen", chosen), ("rejected", rejected)):
            if any(m["role"] != "assistant" for m in value):
                raise DataError(f"{where}: '{key}' must hold assistant messages only (the prompt holds the rest)")


def conversation(record: dict) -> list[dict] | None:
    """The messages of a conversational pair up to its chosen answer (None for a pair of strings): what the
    message warnings (checks.py) read, as they read an SFT record's messages."""
    prompt, chosen = _prompt_of(record), record.get("chosen")
    if not isinstance(chosen, list):
        return None
    return (prompt if isinstance(prompt, list) else []) + chosen


def explicit_prompt(record: dict) -> bool:
    """Whether the pair gives its prompt (else it is the shared start of chosen and rejected)."""
    return _prompt_of(record) is not None


def _shared_prefix(a, b) -> int:
    """Length of the common start of two strings or two message lists, as TRL's ``extract_prompt``: a
    string prompt does not keep the space before the responses."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    if n < min(len(a), len(b)) and isinstance(a, str) and n and a[n - 1] == " ":
        n -= 1
    return n


def split_pair(record: dict) -> tuple[object, object, object]:
    """(prompt, chosen, rejected), the prompt taken from the responses' shared start when not given."""
    prompt, chosen, rejected = _prompt_of(record), record["chosen"], record["rejected"]
    if prompt is None:
        n = _shared_prefix(chosen, rejected)
        prompt, chosen, rejected = chosen[:n], chosen[n:], rejected[n:]
    return prompt, chosen, rejected


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def pair_ids(tokenizer, record: dict) -> tuple[list[int], list[int], int]:
    """Token ids of prompt + chosen and of prompt + rejected, and where the responses start."""
    prompt, chosen, rejected = split_pair(record)
    if isinstance(prompt, str):
        eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        prompt_ids = tokenizer(prompt)["input_ids"]
        full = [tokenizer(prompt + response)["input_ids"] + eos for response in (chosen, rejected)]
    else:
        bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None and not tokenizer.chat_template else []
        eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None and not tokenizer.chat_template else []

        def ids(text: str) -> list[int]:
            return bos + tokenizer(text, add_special_tokens=False)["input_ids"]

        prompt_ids = ids(rendered(render_prompt, tokenizer, prompt))
        full = [ids(rendered(render_conversation, tokenizer, prompt + response)) + eos
                for response in (chosen, rejected)]
    start = min(_common(prompt_ids, full[0]), _common(prompt_ids, full[1]))
    return full[0], full[1], start


def tokenize_pair(tokenizer, record: dict, seq_len: int) -> tuple[list[Example], bool]:
    """The pair as two examples, chosen then rejected, each cut to ``seq_len``; also whether one was cut."""
    chosen, rejected, start = pair_ids(tokenizer, record)
    if start >= seq_len:
        raise DataError(f"the prompt alone has {start} tokens and fills --seq-len {seq_len}: no response token "
                        f"would be left (raise --seq-len or shorten the prompt)")
    for key, ids in (("chosen", chosen), ("rejected", rejected)):
        if len(ids) <= start:
            raise DataError(f"'{key}' adds no token to the prompt")
    examples = [Example(ids[:seq_len], ([IGNORE] * start + ids[start:])[:seq_len]) for ids in (chosen, rejected)]
    return examples, max(len(chosen), len(rejected)) > seq_len


PAIRS = RecordFormat("pairs", check_pair, tokenize_pair, 2)
