"""An Ollama Modelfile for an exported GGUF: FROM the file, TEMPLATE from the chat template, stop tokens.

Ollama templates are Go templates, not Jinja. Instead of translating Jinja source, the model's chat
template is rendered with placeholder messages: one message per role gives that role's text before
and after its content, and the generation prompt is what ``add_generation_prompt`` adds. Those
pieces make a Go template. A template that takes no lone assistant turn (Gemma: turns must alternate
from a user's) gives the assistant's pieces after a user turn. One with no system turn of its own
but the system text at the start of the first user message (Gemma 3) gets a Go template that does
the same; one that refuses system messages (Gemma 1 and 2) gets no system branch. One that opens a
conversation without a system message with a default one (SmolLM2-Instruct, Qwen2.5: "You are a
helpful assistant…") gets that text as the Modelfile's ``SYSTEM``, which Ollama puts first exactly
when a conversation has no system message of its own. It is kept only if it renders two sample
conversations, with and without a system message, exactly as the Jinja template does (checked here,
by replaying the Go template's logic); a template with logic beyond "wrap each message by its role"
(tools, thinking blocks, other per-position rules) fails that check and the Modelfile says so instead
of carrying a wrong TEMPLATE. The BOS token is left out: llama.cpp adds it itself, as the GGUF's add_bos_token
says.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from shardtune.runtime.files import write_text_atomic

log = logging.getLogger("shardtune")

_MARK = "\x00CONTENT\x00"
_SYSTEM = "\x00SYSTEM\x00"
_SAMPLE = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there"},
           {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Capital of France?"}]


def write_modelfile(model_dir: Path, gguf_file: Path, path: Path) -> dict:
    """Write ``path``; returns {"path", "template" (translated or not), "stop", "note"}."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    pieces, note = _pieces(tok) if tok.chat_template else (None, "the tokenizer has no chat template")
    stops = _stop_tokens(tok, pieces)
    lines = [f"FROM ./{gguf_file.name}", ""]
    if pieces is not None:
        lines += [f'TEMPLATE """{go_template(pieces)}"""', ""]
        if "default_system" in pieces:  # Ollama adds it when a conversation has no system message, as the template
            lines += [f'SYSTEM """{pieces["default_system"]}"""', ""]
    else:
        lines += [f"# No TEMPLATE: {note}; write one by hand (https://github.com/ollama/ollama/blob/main/docs/"
                  "template.md) or `ollama show --modelfile` a model of the same family.", ""]
        log.warning("Modelfile %s has no TEMPLATE: %s", path, note)
    lines += [f"PARAMETER stop {json.dumps(s)}" for s in stops]
    write_text_atomic(path, "\n".join(lines) + "\n")
    return {"path": str(path), "template": pieces is not None, "stop": stops, "note": note}


def _render(tok, messages: list[dict], generation: bool) -> str:
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation, bos_token="")


def _wrap(tok, context: list[dict], role: str) -> tuple[str, str] | None:
    """(text before, text after) a ``role`` message's content following the ``context`` turns, or None when
    the template refuses that (some refuse a lone assistant or any system turn) or writes the content other
    than once."""
    try:
        prefix = _render(tok, context, False) if context else ""
        text = _render(tok, [*context, {"role": role, "content": _MARK}], False)
    except Exception:  # noqa: BLE001 - a template raises its own errors for turns it does not accept
        return None
    if not text.startswith(prefix) or text[len(prefix):].count(_MARK) != 1:
        return None
    before, after = text[len(prefix):].split(_MARK)
    return before, after


def _folded_system(tok, user: tuple[str, str]) -> str | None:
    """Gemma's way: no system turn, the system text opens the first user message. The text between the
    two (Gemma: a blank line), or None when the template does not do that."""
    try:
        text = _render(tok, [{"role": "system", "content": _SYSTEM}, {"role": "user", "content": _MARK}], False)
    except Exception:  # noqa: BLE001
        return None
    head, tail = user[0] + _SYSTEM, _MARK + user[1]
    if not (text.startswith(head) and text.endswith(tail)) or len(text) < len(head) + len(tail):
        return None
    sep = text[len(head):len(text) - len(tail)]
    return None if _MARK in sep or _SYSTEM in sep else sep


def _pieces(tok) -> tuple[dict | None, str]:
    """{role: (before, after)}, "gen": the generation prompt and, for a template that puts the system text
    into the first user message, "system_in_user": what follows it there; or None and why it cannot be
    translated."""
    pieces: dict = {}
    try:
        user = _render(tok, [{"role": "user", "content": _MARK}], False)
        if user.count(_MARK) != 1:
            return None, "the chat template writes a user message's content other than once"
        pieces["user"] = tuple(user.split(_MARK))
        default = _default_system(tok, pieces["user"])
        if default is not None:
            pieces["user"], pieces["default_system"] = default
        opening = [{"role": "system", "content": "x"}] if default is not None else []  # no default inserted after it
        assistant = _wrap(tok, opening, "assistant") or _wrap(tok, [*opening, {"role": "user", "content": "x"}],
                                                                "assistant")
        if assistant is None:
            return None, "the chat template writes an assistant message's content other than once"
        pieces["assistant"] = assistant
        system = _wrap(tok, [], "system")
        if system is not None:
            pieces["system"] = system
        elif (sep := _folded_system(tok, pieces["user"])) is not None:
            pieces["system_in_user"] = sep
        elif _accepts_system(tok):
            return None, "the chat template writes a system message's content other than once"
        turn = [{"role": "user", "content": _MARK}]
        pieces["gen"] = _render(tok, turn, True).removeprefix(_render(tok, turn, False))
    except Exception as err:  # noqa: BLE001 - Jinja errors of any kind mean: not translatable
        return None, f"the chat template could not be rendered ({type(err).__name__}: {err})"
    samples = [_SAMPLE, _SAMPLE[1:]] if "system" in pieces or "system_in_user" in pieces else [_SAMPLE[1:]]
    for sample in samples:
        try:
            expected = _render(tok, sample, True)
        except Exception as err:  # noqa: BLE001
            return None, f"the chat template could not render a sample conversation ({err})"
        if _replay(pieces, sample) != expected:
            return None, ("the chat template does more than wrap each message by its role (e.g. rules for the "
                          "first or last turn, tools, reasoning), which this translation to a Go template does not "
                          "cover")
    return pieces, ""


def _default_system(tok, user: tuple[str, str]) -> tuple[tuple[str, str], str] | None:
    """For a template that opens a conversation without a system message with a system turn of its own text
    (SmolLM2-Instruct's "You are a helpful AI assistant named SmolLM…"): (the user's own pieces, that text);
    else None."""
    system = _wrap(tok, [], "system")
    own = _wrap(tok, [{"role": "system", "content": "x"}], "user")  # after a system message: no default added
    if system is None or own is None or own == user:
        return None
    head, tail = user[0], user[1]
    opened = head.removesuffix(own[0])
    if tail != own[1] or opened == head or not (opened.startswith(system[0]) and opened.endswith(system[1])):
        return None
    text = opened[len(system[0]):len(opened) - len(system[1])]
    return (own, text) if text and '"""' not in text and _MARK not in text else None


def _accepts_system(tok) -> bool:
    """Whether the template renders a system message at all (Gemma 1 and 2 refuse one)."""
    try:
        _render(tok, [{"role": "system", "content": _SYSTEM}, {"role": "user", "content": _MARK}], False)
    except Exception:  # noqa: BLE001
        return False
    return True


def _replay(pieces: dict, messages: list[dict]) -> str:
    """What ``go_template(pieces)`` renders for ``messages``, as Ollama would (system first, then the turns)."""
    if "default_system" in pieces and (not messages or messages[0]["role"] != "system"):
        messages = [{"role": "system", "content": pieces["default_system"]}, *messages]  # Ollama's SYSTEM
    folded = "system_in_user" in pieces
    system = ""
    for m in messages:
        if m["role"] == "system":
            system = m["content"]
    out, first = "", True
    for m in messages:
        if m["role"] == "system" and folded:
            continue
        before, after = pieces[m["role"]]
        out += before
        if m["role"] == "user":
            if first and folded and system:
                out += system + pieces["system_in_user"]
            first = False
        out += m["content"] + after
    return out + pieces["gen"]


def _go(text: str) -> str:
    return text.replace("{{", '{{ "{{" }}')


def go_template(pieces: dict) -> str:
    """The Go template of Ollama's .Messages form, each role wrapped as the chat template wraps it.

    Only actions that follow no text carry ``{{-``: Go's dash trims the whitespace of the text before
    it, which would drop the newline that ends a turn.
    """
    folded = "system_in_user" in pieces
    head = ('{{- $system := "" }}{{- range .Messages }}{{- if eq .Role "system" }}{{- $system = .Content }}'
            "{{- end }}{{- end }}{{- $first := true }}") if folded else ""
    branches = []
    for i, role in enumerate(r for r in ("system", "user", "assistant") if r in pieces):
        before, after = pieces[role]
        keyword = "{{- if" if i == 0 else "{{ else if"
        content = "{{ .Content }}"
        if role == "user" and folded:
            content = (f'{{{{ if and $first $system }}}}{{{{ $system }}}}{_go(pieces["system_in_user"])}{{{{ end }}}}'
                       "{{ $first = false }}{{ .Content }}")
        branches.append(f'{keyword} eq .Role "{role}" }}}}{_go(before)}{content}{_go(after)}')
    return head + "{{- range .Messages }}" + "".join(branches) + "{{ end }}{{ end }}" + _go(pieces["gen"])


def _stop_tokens(tok, pieces: dict | None) -> list[str]:
    """The end-of-turn markers: EOS and any special token that closes an assistant message."""
    stops = [tok.eos_token] if tok.eos_token else []
    if pieces and "assistant" in pieces:
        specials = set(tok.all_special_tokens) | {str(t) for t in tok.added_tokens_decoder.values() if t.special}
        for special in sorted(specials, key=len, reverse=True):
            if special in pieces["assistant"][1] and special not in stops:
                stops.append(special)
    return stops
