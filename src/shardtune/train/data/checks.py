"""Warnings about data that will not do what the user thinks, with the numbers and the record that shows it.

Nothing here is an error: the run can go on, but a user who reads these would change something. Each
is said once per file, naming the records (their lines) that show it. The message warnings read every
record's conversation alike, an SFT record's messages or a pair's (pairs.conversation): one check of
roles and user turns for every objective.
"""

from __future__ import annotations

import logging
from pathlib import Path

from shardtune.train.data.pairs import conversation, explicit_prompt, split_pair

log = logging.getLogger("shardtune")

# Roles chat templates know; any other is rendered by the template as it sees fit (often as a user
# turn, or silently dropped), and by the plain layout as an instruction.
KNOWN_ROLES = ("system", "user", "assistant", "tool")


def _lines(lines: list[int]) -> str:
    return ", ".join(str(n) for n in lines[:5]) + (", …" if len(lines) > 5 else "")


def _messages_of(record: object) -> list[dict] | None:
    """A record's conversation: an SFT record's messages, a conversational pair's (None: no messages)."""
    if not isinstance(record, dict):
        return None
    if "chosen" in record:
        return conversation(record)
    messages = record.get("messages")
    return messages if isinstance(messages, list) else None


def data_warnings(path: str | Path, records: list[tuple[int, dict]], usable: int, batch_size: int) -> list[str]:
    """The warnings for training data ``path``: its (line, record) pairs, ``usable`` of them with a target."""
    found = []
    if usable < batch_size:
        found.append(f"{path}: only {usable} usable record{'s' * (usable != 1)} for --batch-size {batch_size}: "
                     f"every optimizer step repeats records (each about {batch_size / usable:.1f} times); "
                     f"a batch size of at most {usable} sees each record once per step")
    return found + message_warnings(path, records)


def message_warnings(path: str | Path, records: list[tuple[int, dict]]) -> list[str]:
    """Chat roles templates do not know, and conversations with no user turn, in SFT records and pairs alike."""
    unknown: dict[str, list[int]] = {}
    no_user: list[int] = []
    for line, record in records:
        messages = _messages_of(record) or ()
        for message in messages:
            role = message.get("role") if isinstance(message, dict) else None
            if isinstance(role, str) and role not in KNOWN_ROLES:
                unknown.setdefault(role, []).append(line)
        if messages and not any(isinstance(m, dict) and m.get("role") == "user" for m in messages):
            no_user.append(line)
    found = []
    for role, lines in unknown.items():
        found.append(f"{path}: chat role {role!r} is not one of {', '.join(KNOWN_ROLES)} "
                     f"({len(lines)} message{'s' * (len(lines) != 1)}, record line {_lines(lines)}); "
                     "the chat template renders it as it sees fit, with no loss on it")
    if no_user:
        found.append(f"{path}: {len(no_user)} of {len(records)} conversations have no user turn (record line "
                     f"{_lines(no_user)}): the model learns answers to no question, which no chat at serving "
                     "time looks like; give each a 'user' message (or mislabelled roles: 'human' is 'user')")
    return found


def tokenizer_warnings(path: str | Path, records: list[tuple[int, dict]], tokenizer, model: str | Path) -> list[str]:
    """What the tokenizer of ``model`` does to this data that the user would not want: chat messages with no
    chat template (rendered in shardtune's plain layout, which no serving stack reproduces), and no EOS
    token (responses never end in one, so the adapter never learns to stop)."""
    found = []
    chats = [line for line, record in records if _messages_of(record)]
    if chats and not tokenizer.chat_template:
        found.append(f"{path}: {len(chats)} of {len(records)} records are chat messages (record line {_lines(chats)}), "
                     f"but the tokenizer of {model} has no chat template: they are rendered in shardtune's plain "
                     "'### Instruction / ### Response' layout, which no serving stack (vLLM, llama.cpp, Ollama) "
                     "reproduces, so the adapter would be asked in another form than it learned; give the model "
                     "directory the chat template of its family (chat_template.jinja, e.g. from its instruct model)")
    if tokenizer.eos_token_id is None:
        found.append(f"the tokenizer of {model} has no EOS token: no response ends in one, so the adapter never "
                     "learns to stop (answers run to --max-new-tokens); set eos_token in its tokenizer_config.json")
    return found


def warn_about_data(path: str | Path, records: list[tuple[int, dict]], usable: int, batch_size: int,
                    tokenizer=None, model: str | Path = "") -> None:
    messages = data_warnings(path, records, usable, batch_size)
    if tokenizer is not None:
        messages += tokenizer_warnings(path, records, tokenizer, model)
    for message in messages:
        log.warning("%s", message)


def pair_warnings(path: str | Path, records: list[tuple[int, dict]], truncated: int, seq_len: int) -> list[str]:
    """Warnings with counts: pairs whose chosen and rejected are the same, pairs cut by ``seq_len``, and a
    file that mixes pairs with a prompt and pairs without (their prompt the responses' shared start)."""
    found = []
    same = [line for line, r in records if split_pair(r)[1] == split_pair(r)[2]]
    if same:
        found.append(f"{path}: {len(same)} of {len(records)} pairs have the same chosen and rejected response "
                     f"(record {_lines(same)}): they add nothing to the preference loss")
    if truncated:
        found.append(f"{path}: {truncated} of {len(records)} pairs are longer than --seq-len {seq_len}: their "
                     f"responses are cut at the end (the prompt is kept whole, as TRL's keep_start does)")
    implicit = [line for line, r in records if not explicit_prompt(r)]
    if implicit and len(implicit) < len(records):
        found.append(f"{path}: {len(records) - len(implicit)} pairs give a 'prompt' and {len(implicit)} do not "
                     f"(record line {_lines(implicit)}: their prompt is taken as the shared start of chosen and "
                     "rejected); a file normally holds one form: check that those records were not cut or "
                     "mis-mapped (--data-fields prompt=COLUMN)")
    return found


#: fields of other objectives' records: on prompts for GRPO, only fields for the rewards
_OTHER_FORMS = (("chosen", "a preference pair's", "--objective dpo, orpo or simpo"),
                ("rejected", "a preference pair's", "--objective dpo, orpo or simpo"),
                ("output", "an SFT record's", "--objective sft"), ("response", "an SFT record's", "--objective sft"),
                ("completion", "a prompt-completion record's", "--objective sft"))


def prompt_warnings(path: str | Path, records: list[tuple[int, dict]]) -> list[str]:
    """Warnings for prompts (GRPO's) read from another objective's records: their responses are no target here,
    only fields handed to the reward functions, and an SFT record's ``input`` is no part of the prompt."""
    found = []
    for key, form, objective in _OTHER_FORMS:
        lines = [line for line, r in records if key in r]
        if lines:
            found.append(f"{path}: {len(lines)} of {len(records)} records have {key!r} (record {_lines(lines)}), "
                         f"{form} field: --objective grpo samples its own completions and hands {key!r} to the reward "
                         f"functions as a field only (to train on it: {objective})")
    inputs = [line for line, r in records if "instruction" in r and str(r.get("input") or "").strip()]
    if inputs:
        found.append(f"{path}: {len(inputs)} of {len(records)} records have an 'input' beside their 'instruction' "
                     f"(record {_lines(inputs)}): the prompt is the instruction alone; 'input' reaches the reward "
                     "functions as a field. Put it in the prompt if the model must see it")
    return found
