"""Chat records as text: the tokenizer's chat template when it has one, else a plain
"### Instruction / ### Response" layout; also what generation renders a prompt with."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from shardtune.train.data.records import DataError


def check_messages(messages: object, key: str, where: str) -> None:
    """The one shape check of a message list, wherever records hold one (SFT ``messages``, a pair's ``prompt``,
    ``chosen`` and ``rejected``): a non-empty list of objects with string ``role`` and ``content``. What a
    list then lacks (a user turn) or holds that templates do not know (a role) is warned about (checks.py)."""
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: '{key}' must be a non-empty list of messages")
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise DataError(f"{where}: {key}[{i}] must be an object with string 'role' and 'content'")


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


def render_tokens(tokenizer, messages: list[dict]) -> list[tuple[str, bool]]:
    """The conversation as consecutive (text, is_target) pieces (``_segments``), with a chat template's
    refusal (a jinja error, say) as a DataError about the record."""
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
