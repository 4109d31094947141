"""Your own FSDP2 training loop with shardtune's shard-only loader: a few steps on a text file.

    torchrun --nproc-per-node 2 examples/own_loop.py --model models/smollm2-135m --data examples/tiny_text.jsonl

Each rank reads only its shard of the weights (``shardtune.load_sharded``); the rest is plain
PyTorch: your data, your loss, your optimizer. Every rank must run every forward and backward (the
model runs collectives in forward), so each rank takes its own records of the same global batch.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist
from transformers import AutoTokenizer

import shardtune


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="model directory or Hub id")
    parser.add_argument("--data", default="examples/tiny_text.jsonl", help='.jsonl of {"text": ...} records')
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--dtype", default="fp32", choices=("bf16", "fp32"))
    args = parser.parse_args()

    dist.init_process_group("gloo" if not torch.cuda.is_available() else "nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", rank % torch.cuda.device_count()) if torch.cuda.is_available() else None
    if device is not None:
        torch.cuda.set_device(device)
    model = shardtune.load_sharded(args.model, {"r": 8, "alpha": 16, "targets": "all-linear"}, dtype=args.dtype)
    tokenizer = AutoTokenizer.from_pretrained(args.model)  # a directory or Hub id, as for the model
    texts = [json.loads(line)["text"] for line in open(args.data) if line.strip()]
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    model.train()
    for step in range(args.steps):
        text = texts[(step * world + rank) % len(texts)]  # this rank's record of the global batch
        ids = tokenizer(text, return_tensors="pt", truncation=True, max_length=128).input_ids
        ids = ids.to(device) if device is not None else ids
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()  # FSDP2 averages the gradients over ranks
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().float().clone()
        dist.all_reduce(mean)
        if rank == 0:
            print(f"step {step + 1}: loss {mean.item() / world:.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
