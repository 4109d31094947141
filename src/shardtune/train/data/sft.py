"""Supervised fine-tuning records, checked and tokenized:

  {"instruction", "input"?, "output"}   loss on the output only
  {"messages": [{"role", "content"}, …]} loss on assistant turns only
  {"text"}                              loss on every token
(ShareGPT records arrive here as messages: sources.py.)
"""

from __future__ import annotations

from shardtune.train.data.chat import as_messages, check_messages, render_tokens
from shardtune.train.data.records import IGNORE, DataError, Example, RecordFormat


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
        check_messages(msgs, "messages", where)
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
        for text, is_target in render_tokens(tokenizer, messages):
            piece = tokenizer(text, add_special_tokens=False)["input_ids"]
            ids += piece
            labels += piece if is_target else [IGNORE] * len(piece)
        if not tokenizer.chat_template and tokenizer.eos_token_id is not None:
            ids.append(tokenizer.eos_token_id)
            labels.append(tokenizer.eos_token_id)
    cut = len(ids) > seq_len
    return Example(ids[:seq_len], labels[:seq_len]), cut


def _tokenize_sft(tokenizer, record: dict, seq_len: int) -> tuple[list[Example], bool]:
    example, cut = tokenize(tokenizer, record, seq_len)
    return [example], cut


SFT = RecordFormat("sft", check_record, _tokenize_sft, 1)
