"""A Hugging Face tokenizer (tokenizer.json) as llama.cpp's GGUF tokenizer metadata.

Two kinds of tokenizer.json are written, as llama.cpp's convert_hf_to_gguf.py writes them:

* byte-level BPE (GPT-2 style: SmolLM, Qwen, Llama 3): ``tokenizer.ggml.model = "gpt2"``, the
  tokens in their byte-alphabet spelling, the merges, and ``tokenizer.ggml.pre`` naming the split
  regex (llama.cpp picks its pre-tokenizer by that name).
* BPE with byte fallback (SentencePiece style: Llama 2, Mistral, Gemma): ``"llama"``, tokens with
  ``▁``, ``<0xNN>`` byte tokens typed BYTE, and a score per token. SentencePiece merges the pair of
  highest score, so each token scores minus the rank of the merge that makes it (earlier merges win,
  as in the fast tokenizer); the merges are written too, for readers that rebuild a BPE from them.

Special token ids, add_bos/add_eos and the chat template come from the gguf package's own
``SpecialVocab``. Token ids past the tokenizer's length (an embedding padded to a round size) become
``[PADn]`` tokens of type UNUSED, as llama.cpp does, so that the token list matches the embedding rows.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

from shardtune.errors import ShardtuneError

log = logging.getLogger("shardtune")

# The split regexes of the pre-tokenizers llama.cpp names, as tokenizer.json spells them.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_PRE_BY_SPLIT = {_LLAMA3_SPLIT: "llama-bpe", _QWEN2_SPLIT: "qwen2"}


class VocabError(ShardtuneError, ValueError):
    """The model's tokenizer cannot be written as GGUF metadata; the message names the file and why."""


def add_tokenizer(writer, model_dir: Path, n_vocab: int) -> None:
    """Add the tokenizer of ``model_dir`` to ``writer``'s metadata, padded to ``n_vocab`` tokens."""
    import gguf

    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise VocabError(f"{model_dir} has no tokenizer.json: GGUF export needs the fast tokenizer's file "
                         "(save the tokenizer with transformers to write one)")
    data = json.loads(path.read_text(encoding="utf-8"))
    model = data.get("model") or {}
    if model.get("type") != "BPE":
        raise VocabError(f"{path}: a {model.get('type')!r} tokenizer; GGUF export writes BPE tokenizers only "
                         "(byte-level like GPT-2/Qwen/Llama 3, or SentencePiece-style with byte fallback)")
    spm = bool(model.get("byte_fallback"))
    tokens = _tokens(model["vocab"], data.get("added_tokens") or [], n_vocab, path)
    added = {t["id"]: t for t in data.get("added_tokens") or []}
    ranks = _merge_ranks(model.get("merges") or [])
    types, scores = [], []
    for i, token in enumerate(tokens):
        if i in added:
            types.append(gguf.TokenType.CONTROL if added[i].get("special") else gguf.TokenType.USER_DEFINED)
        elif token.startswith("[PAD") and i >= len(model["vocab"]) + len(added):
            types.append(gguf.TokenType.UNUSED)
        elif spm and re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", token):
            types.append(gguf.TokenType.BYTE)
        else:
            types.append(gguf.TokenType.NORMAL)
        scores.append(-1000.0 if i in added else -float(ranks.get(token, 0)))

    writer.add_tokenizer_model("llama" if spm else "gpt2")
    if spm:
        writer.add_add_space_prefix(_adds_space_prefix(data))
    else:
        writer.add_tokenizer_pre(_pre_name(data, path))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    if spm:
        writer.add_token_scores(scores)
    special = gguf.SpecialVocab(model_dir, load_merges=True, n_vocab=n_vocab)
    special.add_special_token.update(_adds_bos_eos(model_dir))
    special.add_to_gguf(writer, quiet=True)


def _adds_bos_eos(model_dir: Path) -> dict[str, bool]:
    """Whether the tokenizer adds BOS/EOS, as it behaves (transformers 5 may not say so in tokenizer_config.json,
    and readers then guess: transformers' GGUF reader assumes BOS for SentencePiece-style vocabularies)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    plain, full = tok("a", add_special_tokens=False)["input_ids"], tok("a")["input_ids"]
    bos = tok.bos_token_id is not None and len(full) > len(plain) and full[0] == tok.bos_token_id
    eos = tok.eos_token_id is not None and len(full) > len(plain) and full[-1] == tok.eos_token_id
    return {"bos": bool(bos), "eos": bool(eos)}


def _tokens(vocab: dict[str, int], added: list[dict], n_vocab: int, path: Path) -> list[str]:
    by_id = {i: t for t, i in vocab.items()}
    by_id.update({t["id"]: t["content"] for t in added})
    size = max(by_id) + 1 if by_id else 0
    if size > n_vocab:
        raise VocabError(f"{path}: the tokenizer has ids up to {size - 1}, but the model's embedding has only "
                         f"{n_vocab} rows")
    return [by_id.get(i, f"[PAD{i}]") for i in range(n_vocab)]


def _merge_ranks(merges: list) -> dict[str, int]:
    """{token: 1 + rank of the first merge that makes it}; tokens no merge makes are absent (rank 0)."""
    ranks: dict[str, int] = {}
    for rank, merge in enumerate(merges):
        left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
        ranks.setdefault(left + right, rank + 1)
    return ranks


def _pre_name(data: dict, path: Path) -> str:
    """llama.cpp's name for the way this tokenizer splits text before BPE."""
    pre = data.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    kinds = [s.get("type") for s in steps]
    if kinds == ["ByteLevel"]:
        return "gpt-2" if steps[0].get("use_regex", True) else "default"
    if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits"):
        return "smollm"
    splits = [s.get("pattern", {}).get("Regex") for s in steps if s.get("type") == "Split"]
    if splits and splits[0] in _PRE_BY_SPLIT:
        return _PRE_BY_SPLIT[splits[0]]
    log.warning("%s: a pre-tokenizer llama.cpp has no name for (%s); written as 'default', so llama.cpp may split "
                "text differently from transformers", path, "+".join(str(k) for k in kinds))
    return "default"


def _adds_space_prefix(data: dict) -> bool:
    """Whether a SentencePiece-style tokenizer puts ``▁`` before the first word (normalizer or Metaspace)."""
    text = json.dumps([data.get("normalizer"), data.get("pre_tokenizer")])
    return '"Prepend"' in text or ('"Metaspace"' in text and '"prepend_scheme": "never"' not in text)
