"""Answers from a base model, with or without a LoRA adapter: what `shardtune generate` and `eval` run.

One process, one device. Prompts are rendered exactly as training renders the text before an
answer (chat template, else the plain "### Instruction / ### Response" layout), so an adapter is
asked its questions in the form it learned them. Greedy decoding (temperature 0, the default) is
deterministic and runs in left-padded batches; sampling uses temperature and top-p (no top-k).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import torch
from torch import nn

from shardtune.config import ConfigError
from shardtune.errors import plain_suffix, read_text
from shardtune.model.adapter_dir import AdapterDirError
from shardtune.model.adapter_dir import check_adapter_dir as check_peft_dir
from shardtune.model.directory import ModelDir, check_model_dir, load_tokenizer
from shardtune.model.meta import DTYPES, build_meta_model
from shardtune.runtime.device import auto_dtype, pick_device
from shardtune.train.data.batch import pad_id
from shardtune.train.data.chat import as_messages, render_prompt
from shardtune.train.data.read import loads
from shardtune.train.data.records import DataError
from shardtune.train.run_folder import adapter_run_options
from shardtune.train.sampling import stop_ids

log = logging.getLogger("shardtune")

# A prompt is a user message's text, or a whole conversation whose next turn is the assistant's.
Prompt = str | list[dict]


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto``: as a fine-tune's ``--dtype auto`` on ``device`` (bf16 where it computes in it natively)."""
    if name == "auto":
        return DTYPES[auto_dtype(device.type)]
    if name not in DTYPES:
        raise ConfigError(f"option 'dtype': {name!r} is not one of auto, {', '.join(DTYPES)}")
    return DTYPES[name]


@dataclass(frozen=True)
class EvalModel:
    """The model a tool evaluates: a base, maybe an adapter, and how to load them (``load_model``)."""

    model: str
    adapter: str | None = None
    dtype: str = "auto"
    quantize: str = "none"
    trust_remote_code: bool = False

    def load(self, device: torch.device | None = None) -> tuple[nn.Module, object]:
        return load_model(self.model, self.adapter, self.dtype, device, self.quantize, self.trust_remote_code)


def load_model(model_dir: str | Path, adapter: str | Path | None = None, dtype: str = "auto",
               device: torch.device | None = None, quantize: str = "none",
               trust_remote_code: bool = False, check_base: bool = True) -> tuple[nn.Module, object]:
    """The full model on one device (``from_pretrained``, then ``PeftModel.from_pretrained``), in eval mode.

    ``quantize="nf4"``: the base as a QLoRA fine-tune trained on it (``"auto"``: as the adapter's run did,
    ``resolve_quantize``), its decoder-layer Linear weights in
    4-bit NF4, quantized from ``dtype`` as training quantizes from its ``--dtype`` (auto: the same
    choice as training's auto on the same kind of machine).
    ``trust_remote_code``: a model that names its own code (config ``auto_map``) may run it.
    ``check_base``: the adapter is checked to be made from this base (model/adapter_dir.py); False in the
    worker processes of a command whose launcher checked it.
    """
    from transformers import AutoModelForCausalLM

    from shardtune.model import quantize as nf4

    quantize = resolve_quantize(quantize, adapter)
    if quantize not in nf4.NF4_CHOICES:
        raise ConfigError(f"option 'quantize': {quantize!r} is not one of {', '.join(nf4.NF4_CHOICES)}")
    if quantize == "nf4":
        nf4.check_available()
    checked = check_model_dir(model_dir, trust_remote_code)
    path = checked.path
    check_adapter_dir(adapter, checked if check_base else None)
    device = device or pick_device()
    tokenizer = load_tokenizer(checked)
    if quantize == "nf4":
        model = load_quantized(checked, resolve_dtype(dtype, device), device)
    else:  # each weight read straight onto the device: the host never holds the whole model
        model = AutoModelForCausalLM.from_pretrained(path, dtype=resolve_dtype(dtype, device),
                                                     trust_remote_code=trust_remote_code, device_map={"": device})
    if adapter is not None:
        from peft import PeftModel

        from shardtune.model.lora_forward import fuse_lora_forward

        try:
            model = PeftModel.from_pretrained(model, str(adapter))
        except (ValueError, KeyError, RuntimeError) as err:  # e.g. made for another model: shapes, names
            reason = _first_misfit(err)
            raise AdapterDirError(f"adapter {adapter} does not fit the model {path}: {reason}") from None
        fuse_lora_forward(model)  # as the fine-tune ran it
    return model.to(device).eval(), tokenizer


def resolve_quantize(quantize: str, adapter: str | Path | None) -> str:
    """``--quantize auto``: the base the fine-tune that wrote ``adapter`` trained on, read from its run folder's
    config.yaml (nf4 for a QLoRA run, said in a note), else none; any other value as given."""
    if quantize != "auto":
        return quantize
    trained = adapter_run_options(adapter).get("quantize")
    if trained == "nf4":
        log.warning("--quantize auto: the fine-tune that wrote %s trained on the 4-bit NF4 base (its config.yaml), "
                    "so the base is quantized to NF4 here too (--quantize none: the unquantized base)", adapter)
        return "nf4"
    return "none"


def load_quantized(model_dir: ModelDir, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """The base model with its decoder-layer weights in NF4, as a QLoRA fine-tune held it, built on the
    device one weight at a time: each is read in ``dtype`` and quantized there (the fine-tune's own
    loader, model/loading.py, on one process), so neither the host nor the device ever holds the
    model in ``dtype`` (the values are those of quantizing the whole loaded model)."""
    from transformers import GenerationConfig

    from shardtune.model import quantize as nf4
    from shardtune.model.loading import load, take_snapshot

    model = build_meta_model(model_dir, dtype)
    model.requires_grad_(False)
    selection = nf4.select(model)
    nf4.warn_kept(selection)
    nf4.make_meta_nf4(selection)
    load(model, model_dir, device, take_snapshot(model, {}))
    model.config.use_cache = True  # the meta build turns it off for training; generation wants it
    if (model_dir.path / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(model_dir.path)
    return model


def _first_misfit(err: Exception) -> str:
    """The line of a load error that names a tensor: torch's first line ends at "for PeftModelForCausalLM:"."""
    lines = [ln.strip() for ln in str(err).strip().splitlines() if ln.strip()] or [type(err).__name__]
    named = next((ln for ln in lines if ln.startswith(("size mismatch", "Missing key", "Unexpected key"))), None)
    if named is None:
        return lines[0]
    return named.replace("torch.Size(", "(").replace("base_model.model.", "", 1)


def check_adapter_dir(adapter: str | Path | None, base: ModelDir | None = None) -> None:
    """The one adapter check (model/adapter_dir.py), and with ``base`` that the adapter was made from it."""
    if adapter is not None:
        check_peft_dir(adapter, base=base)


def split_record(record: dict) -> tuple[list[dict], str | None]:
    """A data record as (prompt messages, expected answer or None).

    Instruction records ask instruction (+ input) and expect output; chat records ask everything
    before their last assistant turn and expect that turn; text records are a bare user prompt.
    """
    if "messages" in record or "instruction" in record:
        messages = as_messages({"output": "", **record})
        last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
        if last is None:
            return messages, None
        expected = messages[last]["content"] if "messages" in record or "output" in record else None
        return messages[:last], expected
    return [{"role": "user", "content": record["text"]}], None


def prompt_text(prompt: Prompt) -> str:
    """What was asked: the text of the last user message."""
    if isinstance(prompt, str):
        return prompt
    return next((m["content"] for m in reversed(prompt) if m["role"] == "user"), "")


def read_prompts(path: str | Path) -> list[Prompt]:
    """Prompts from a text file (one per line), or a .jsonl / .json (array) file of instruction,
    messages or text records; data files with answers work too (the answers are not shown)."""
    path = Path(path)
    text = read_text(path, "prompts file", DataError)
    lines = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    if not lines:
        raise DataError(f"{path}: no prompts (the file is empty)")
    suffix = plain_suffix(path)
    if suffix not in (".jsonl", ".json"):
        return [line.strip() for _, line in lines]
    # (where, text) pairs: each line of a .jsonl file, or the whole .json array at once.
    chunks = [(1, text)] if suffix == ".json" else lines
    records = []
    for n, chunk in chunks:
        try:
            # strictly, as data files are read: a key given twice or a lone surrogate is named (data/read.py)
            value = loads(chunk, lambda i, n=n: f"{path}:{i if suffix == '.json' else n}")
        except json.JSONDecodeError as err:
            raise DataError(f"{path}:{n + err.lineno - 1}: not valid JSON: {err.msg}") from None
        # In a .json array the record's index stands in for its line.
        records += list(enumerate(value, 1)) if suffix == ".json" and isinstance(value, list) else [(n, value)]
    prompts: list[Prompt] = []
    for n, record in records:
        if not isinstance(record, dict) or not ({"instruction", "messages", "text"} & set(record)):
            raise DataError(f"{path}:{n}: expected an object with 'instruction', 'messages' or 'text'")
        try:
            messages, _ = split_record(record)
        except (KeyError, TypeError):
            raise DataError(f"{path}:{n}: malformed record (messages need 'role' and 'content')") from None
        prompts.append(messages)
    return prompts


def prompt_ids(tokenizer, prompt: Prompt) -> list[int]:
    """Token ids of the rendered prompt, tokenized as data.tokenize does the text before an answer."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    ids = tokenizer(render_prompt(tokenizer, messages), add_special_tokens=False)["input_ids"]
    if tokenizer.bos_token_id is not None and not tokenizer.chat_template:
        ids = [tokenizer.bos_token_id] + ids
    return ids


def check_context(model: nn.Module, prompts: Sequence[Prompt], encoded: list[list[int]],
                  max_new_tokens: int) -> int | None:
    """The model's context in tokens (``max_position_embeddings``; None: it states none). A prompt that fills
    it is refused (the model never saw positions beyond it: its answer would be noise); one that leaves less
    than ``max_new_tokens`` gets its answer cut at the context's end, said once."""
    context = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if not isinstance(context, int) or not encoded:
        return None
    longest = max(range(len(encoded)), key=lambda i: len(encoded[i]))
    n, text = len(encoded[longest]), prompt_text(prompts[longest])
    shown = f"{'the prompt' if len(encoded) == 1 else f'prompt {longest + 1}'} ({text[:40]!r}{'…' * (len(text) > 40)})"
    if n >= context:
        raise DataError(f"{shown} has {n} tokens, and the model's context is {context} "
                        "(max_position_embeddings in its config.json): no room is left for an answer, and the "
                        "model never saw positions beyond it; shorten the prompt")
    if n + max_new_tokens > context:
        log.warning("%s has %d tokens: with --max-new-tokens %d the answer would run past the model's context of "
                    "%d tokens, so it is cut at %d new tokens", shown, n, max_new_tokens, context, context - n)
    return context


def _streamer(tokenizer, out: TextIO):
    from transformers import TextStreamer

    class _Streamer(TextStreamer):
        def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
            out.write(text + ("\n" if stream_end else ""))
            out.flush()

    return _Streamer(tokenizer, skip_prompt=True, skip_special_tokens=True)


@torch.no_grad()
def generate_answers(model: nn.Module, tokenizer, prompts: Sequence[Prompt], max_new_tokens: int = 128,
                     temperature: float = 0.0, top_p: float = 1.0, seed: int = 0, stream: TextIO | None = None,
                     batch_size: int = 8, on_batch: Callable[[int, int], None] | None = None) -> list[str]:
    """One answer per prompt, in order; special tokens dropped, surrounding whitespace stripped.

    ``stream`` (e.g. sys.stdout) receives each answer's text as it is generated, one prompt at a
    time; otherwise prompts go in left-padded batches of ``batch_size``. Greedy answers do not
    depend on the batching; sampled ones depend on ``seed`` and on the batching.
    ``on_batch(prompts, new tokens)`` after each batch (a progress display).
    """
    if temperature < 0 or not 0 < top_p <= 1 or max_new_tokens < 1:
        raise ConfigError(f"need temperature >= 0, 0 < top-p <= 1 and max-new-tokens >= 1, "
                          f"got {temperature}, {top_p} and {max_new_tokens}")
    if not prompts:
        return []
    from transformers import GenerationConfig

    stops, pad = stop_ids(model, tokenizer), pad_id(tokenizer)
    sampling = temperature > 0
    config = GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=sampling, temperature=temperature if sampling else None,
        top_p=top_p if sampling else None, top_k=0 if sampling else None, eos_token_id=stops, pad_token_id=pad,
    )
    device = next(model.parameters()).device
    encoded = [prompt_ids(tokenizer, p) for p in prompts]
    context = check_context(model, prompts, encoded, max_new_tokens)
    # Similar lengths share a batch, so little of each batch is padding.
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))
    step = 1 if stream is not None else max(1, batch_size)
    torch.manual_seed(seed)
    answers: dict[int, str] = {}
    for start in range(0, len(order), step):
        batch, made = order[start:start + step], 0
        width = max(len(encoded[i]) for i in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, i in enumerate(batch):
            # Left padding: every prompt ends where generation starts; generate derives positions from the mask.
            ids[row, width - len(encoded[i]):] = torch.tensor(encoded[i])
            mask[row, width - len(encoded[i]):] = 1
        config.max_new_tokens = min(max_new_tokens, context - width) if context else max_new_tokens
        out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=config,
                             streamer=_streamer(tokenizer, stream) if stream is not None else None)
        for row, i in enumerate(batch):
            new = out[row, width:].tolist()
            cut = next((k for k, t in enumerate(new) if t in stops), len(new))
            answers[i] = tokenizer.decode(new[:cut], skip_special_tokens=True).strip()
            made += cut
        if on_batch is not None:
            on_batch(len(batch), made)
    return [answers[i] for i in range(len(encoded))]
