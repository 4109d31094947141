"""Prompts for online RL (--objective grpo), in the forms TRL's GRPOTrainer takes:

  {"prompt": str, ...}                  a plain prompt, continued as it is
  {"prompt": [messages], ...}           a conversation, rendered with the chat template's generation prompt
Any other field (``answer``, ``tests``...) is kept and handed to the reward functions, one value per
completion. ``--data-fields prompt=COLUMN`` names another column.

A prompt becomes one example of its token ids; its labels are its ids (it has no response: the completions
are sampled during training), so that every prompt is an item of the sampler. A prompt longer than
--seq-len keeps its last --seq-len tokens (the end holds the question and the generation prompt), and is
counted as cut.
"""

from __future__ import annotations

from shardtune.train.data.chat import check_messages, render_prompt, rendered
from shardtune.train.data.records import DataError, Example, RecordFormat

#: a record's prompt, not one of its fields for the reward functions
_NOT_FIELDS = ("prompt", "instruction")
#: keyword arguments a reward function receives from shardtune itself: no record field may take their names
RESERVED = ("prompts", "completions", "completion_ids", "trainer_state", "log_metric", "log_extra")


def reserved_field_refusal(fields: object) -> str | None:
    """What is wrong with record ``fields`` that take a name reward functions get from shardtune, or None."""
    clash = sorted(set(fields) & set(RESERVED))  # type: ignore[call-overload]
    return (f"the records have a field named {clash[0]!r}, which reward functions receive from shardtune itself; "
            "rename it (--data-fields)") if clash else None


def prompt_of(record: dict) -> str | list[dict]:
    """The record's prompt (``prompt``, or ``instruction`` where --data-fields mapped a column onto it)."""
    return record["prompt"] if "prompt" in record else record["instruction"]


def fields_of(record: dict) -> dict:
    """The record's other fields, as reward functions receive them."""
    return {k: v for k, v in record.items() if k not in _NOT_FIELDS}


def check_prompt(record: object, where: str) -> None:
    """Raise DataError naming the record and field when ``record`` is no usable prompt record."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if "prompt" not in record and "instruction" not in record:
        hint = (" (a preference pair: train it with --objective dpo, orpo or simpo)" if "chosen" in record else
                " (an SFT record: train it with --objective sft)" if {"messages", "text", "output"} & record.keys()
                else "")
        raise DataError(f"{where}: no 'prompt' field (found: {', '.join(sorted(record)) or 'none'}); --objective "
                        f"grpo expects {{\"prompt\": text or messages, ...fields for the rewards}}{hint}")
    if (refused := reserved_field_refusal(record)) is not None:
        raise DataError(f"{where}: {refused}")
    prompt = prompt_of(record)
    if isinstance(prompt, str):
        if not prompt.strip():
            raise DataError(f"{where}: 'prompt' is empty")
    elif isinstance(prompt, list):
        check_messages(prompt, "prompt", where)
        if prompt[-1]["role"] == "assistant":
            raise DataError(f"{where}: the prompt's last message is the assistant's: the completion would continue "
                            "it; end the prompt with the user's message")
    else:
        raise DataError(f"{where}: 'prompt' must be a string or a list of messages, got {type(prompt).__name__}")


def prompt_ids(tokenizer, prompt: str | list[dict]) -> list[int]:
    """The prompt's token ids as generation continues them (TRL's: the tokenizer's own special tokens for a
    string; the chat template with its generation prompt for messages)."""
    if isinstance(prompt, str):
        return tokenizer(prompt)["input_ids"]
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None and not tokenizer.chat_template else []
    return bos + tokenizer(rendered(render_prompt, tokenizer, prompt), add_special_tokens=False)["input_ids"]


def tokenize_prompt(tokenizer, record: dict, seq_len: int) -> tuple[list[Example], bool]:
    ids = prompt_ids(tokenizer, prompt_of(record))
    if len(ids) < 2:  # an example's first token is never a target: one token would count as no prompt at all
        raise DataError(f"the prompt has {len(ids)} token(s); give at least two")
    kept = ids[-seq_len:]
    return [Example(kept, list(kept))], len(ids) > seq_len


PROMPTS = RecordFormat("prompts", check_prompt, tokenize_prompt, 1)
