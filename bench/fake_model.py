"""Random-weight Llama-shape checkpoints of a given size, written like the Hub lays them out.

The weights are written tensor by tensor straight into safetensors files (the header is computed
from the shapes first), so making a 7B checkpoint needs one tensor's memory, not the model's. The
directory also gets a tokenizer (the tests' byte-level one: 259 ids, all below the model's vocab)
and a small instruction data file whose records fill ``--seq-len`` tokens.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from shardtune.runtime.safetensors_header import encode_header

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from tiny import make_tokenizer  # noqa: E402  (the tests' tokenizer: one source for both)


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int = 32000


SIZES: dict[str, Shape] = {
    "tiny": Shape(64, 2, 128, 4, 2, vocab=512),
    "80m": Shape(1024, 6, 2816, 16, 4, vocab=8000),  # under the 100M-parameter line: no bigrun lock
    "150m": Shape(768, 16, 2048, 12, 4),
    "1.1b": Shape(2048, 22, 5632, 32, 4),  # TinyLlama-1.1B
    "7b": Shape(4096, 32, 11008, 32, 32),  # Llama-2-7B
}


def tensor_shapes(s: Shape) -> list[tuple[str, tuple[int, ...]]]:
    """Names and shapes in the order the Hub's Llama checkpoints store them (untied lm_head)."""
    head_dim = s.hidden // s.heads
    kv = s.kv_heads * head_dim
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (s.vocab, s.hidden))]
    for i in range(s.layers):
        p = f"model.layers.{i}."
        out += [
            (p + "input_layernorm.weight", (s.hidden,)),
            (p + "self_attn.q_proj.weight", (s.hidden, s.hidden)),
            (p + "self_attn.k_proj.weight", (kv, s.hidden)),
            (p + "self_attn.v_proj.weight", (kv, s.hidden)),
            (p + "self_attn.o_proj.weight", (s.hidden, s.hidden)),
            (p + "post_attention_layernorm.weight", (s.hidden,)),
            (p + "mlp.gate_proj.weight", (s.intermediate, s.hidden)),
            (p + "mlp.up_proj.weight", (s.intermediate, s.hidden)),
            (p + "mlp.down_proj.weight", (s.hidden, s.intermediate)),
        ]
    return out + [("model.norm.weight", (s.hidden,)), ("lm_head.weight", (s.vocab, s.hidden))]


def _shards(shapes: list[tuple[str, tuple[int, ...]]], itemsize: int, max_bytes: int) -> list[list[int]]:
    """Consecutive tensors grouped into files of at most ``max_bytes`` (a bigger tensor gets its own)."""
    groups: list[list[int]] = [[]]
    size = 0
    for i, (_, shape) in enumerate(shapes):
        n = math.prod(shape) * itemsize
        if groups[-1] and size + n > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(i)
        size += n
    return groups


def _write_safetensors(path: Path, items: list[tuple[str, tuple[int, ...]]], dtype: torch.dtype,
                       generator: torch.Generator) -> None:
    tmp = path.with_suffix(".tmp")
    with tmp.open("wb") as f:
        f.write(encode_header([(name, dtype, shape) for name, shape in items], {"format": "pt"}))
        for name, shape in items:
            if name.endswith("norm.weight"):
                t = torch.ones(shape, dtype=dtype)
            else:
                # std 0.02 as in Llama's init: activations and logits stay in a sane range
                t = torch.empty(shape, dtype=dtype).normal_(0.0, 0.02, generator=generator)
            f.write(memoryview(t.view(torch.uint8).numpy()))  # numpy has no bf16; bytes are bytes
            del t
    tmp.rename(path)


def write_config(path: Path, s: Shape) -> None:
    from transformers import LlamaConfig

    LlamaConfig(
        hidden_size=s.hidden, intermediate_size=s.intermediate, num_hidden_layers=s.layers,
        num_attention_heads=s.heads, num_key_value_heads=s.kv_heads, vocab_size=s.vocab,
        max_position_embeddings=2048, tie_word_embeddings=False, rms_norm_eps=1e-5,
        bos_token_id=256, eos_token_id=257, pad_token_id=258, dtype="bfloat16",
    ).save_pretrained(path)


def make_checkpoint(size: str, cache: Path, shard_bytes: int = 1 << 30, seed: int = 0) -> Path:
    """The model directory for ``size`` under ``cache``, made once (a finished one has its index)."""
    s = SIZES[size]
    path = cache / f"llama-{size}"
    index_file = path / "model.safetensors.index.json"
    if index_file.is_file():
        return path
    path.mkdir(parents=True, exist_ok=True)
    dtype = torch.bfloat16
    shapes = tensor_shapes(s)
    groups = _shards(shapes, dtype.itemsize, shard_bytes)
    generator = torch.Generator().manual_seed(seed)
    weight_map: dict[str, str] = {}
    for k, group in enumerate(groups, start=1):
        file = f"model-{k:05d}-of-{len(groups):05d}.safetensors"
        items = [shapes[i] for i in group]
        print(f"  writing {path.name}/{file} ({len(items)} tensors)", file=sys.stderr, flush=True)
        _write_safetensors(path / file, items, dtype, generator)
        weight_map.update({name: file for name, _ in items})
    write_config(path, s)
    make_tokenizer().save_pretrained(path)
    total = sum(math.prod(shape) for _, shape in shapes) * dtype.itemsize
    index_file.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return path


def make_data(path: Path, n: int = 32, seq_len: int = 128) -> Path:
    """Instruction records of at least ``seq_len`` byte tokens, with targets left after truncation."""
    if path.is_file():
        return path
    words = ["red", "blue", "cat", "dog", "sun", "moon", "tree", "sea", "rock", "bird", "river", "stone"]
    g = torch.Generator().manual_seed(0)
    lines = []
    for i in range(n):
        picked = [words[int(j)] for j in torch.randint(0, len(words), (seq_len,), generator=g)]
        prompt = " ".join(picked[:8])
        lines.append(json.dumps({"instruction": f"Record {i}: repeat {prompt}", "output": " ".join(picked)}))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--cache", type=Path, default=Path(__file__).parent / ".cache")
    args = parser.parse_args()
    print(make_checkpoint(args.size, args.cache))


if __name__ == "__main__":
    main()
