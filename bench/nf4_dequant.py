"""How fast an NF4 weight is dequantized: torchao's ``get_original_weight`` against shardtune's.

    .venv/bin/python bench/nf4_dequant.py [--device cuda]

Every NF4 matmul dequantizes its weight (a training micro-batch does it three times a weight under
activation checkpointing: forward, recompute, backward). Times, per weight shape and dtype, the mean of
``--repeat`` dequantizations (after one warm-up) with one compute thread and the allocator settings of
shardtune's CPU workers (runtime/cpu_tuning.py: every buffer of 128 KiB or more is a fresh mapping, backed
by huge pages; the process restarts itself with glibc's tunable for them):

  torchao     torchao's own ``NF4Tensor.get_original_weight``
  pair rows   shardtune's chunked dequantization as it was: each packed byte looked up as a row of two values
              in a (256, 2) table
  pair ints   shardtune's now (model/nf4_torchao.py): the same table with each pair's bits as one integer of
              twice the width, a gather of single elements

All three give the same values bit for bit (checked here). Shapes: the MLP and attention projections of a
1.1B Llama (TinyLlama's) and of SmolLM2-135M. Prints a table with each row's ratio to torchao and writes
bench/results/nf4-dequant.json.

A second table times one ``F.linear`` call for one token on SmolLM2-135M's q_proj (576 x 576), fp32: what a
generated token's forward pays per weight beyond the product. Rows: a plain weight; the NF4 weight through
torchao's ``linear_nf4`` and through shardtune's ``linear`` (what ``F.linear`` on an NF4 weight runs now), each
inside ``dequantized_once`` (GRPO's generation: the values made once, looked up) and dequantizing in every
call, without gradients and with the input requiring one (the forward of a training step); each the fastest of
15 rounds of calls, the recipes taking turns within each round.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

import torch

from record import run_record
from shardtune.model import nf4_torchao
from shardtune.model.quantize import quantize_whole
from shardtune.runtime.cpu_tuning import tune_malloc, worker_malloc_env

HERE = Path(__file__).resolve().parent
SHAPES = {"1.1b mlp": (5632, 2048), "1.1b q_proj": (2048, 2048), "135m mlp": (1536, 576), "135m q_proj": (576, 576)}


def pair_rows(t: torch.Tensor) -> torch.Tensor:
    """shardtune's dequantization before the pair table held integers: the same chunks, rows of two values."""
    scalers = t.dequantize_scalers(t.quantized_scalers, t.quantization_factor, t.scaler_block_size)
    half = t.block_size // 2
    index = torch.arange(256, device=t.nf4.device)
    pairs = torch.stack([t.nf4[index >> 4], t.nf4[index & 0b1111]], dim=-1)
    out = torch.empty(t.quantized_data.numel() // half, half, 2, dtype=t.dtype, device=t.device)
    blocks = max(1, nf4_torchao.DEQUANT_CHUNK // half)
    for first in range(0, out.shape[0], blocks):
        codes = t.quantized_data[first * half:(first + blocks) * half].to(torch.int32)
        chunk = pairs.index_select(0, codes).view(-1, half, 2)
        torch.mul(chunk, scalers[first:first + blocks, None, None], out=out[first:first + blocks])
    return out.view(t.shape)


def seconds(fn, t: torch.Tensor, repeat: int, device: torch.device) -> float:
    fn(t)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    started = time.perf_counter()
    for _ in range(repeat):
        fn(t)
    sync()
    return (time.perf_counter() - started) / repeat


def call_rows(module, device: torch.device, calls: int = 200, rounds: int = 15) -> list[dict]:
    """Microseconds per ``F.linear`` call for one token (module doc), the same outputs checked first: each
    recipe's fastest round of ``calls`` calls, the recipes taking turns within every round (a shared machine only
    ever adds time to a call, and it changes from second to second)."""
    import torch.nn.functional as F

    weight = quantize_whole(torch.randn(576, 576, device=device))
    plain = weight.get_original_weight()
    x = torch.randn(1, 576, device=device)
    recipes = {"plain weight": lambda i: F.linear(i, plain),
               "torchao linear_nf4": lambda i: module.linear_nf4(i, weight),
               "shardtune linear": lambda i: nf4_torchao.linear(i, weight)}
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    runs = [(f"{name}{', dequantized once' if once else ''}", fn, once)
            for once in (True, False) for name, fn in recipes.items() if not (once and name == "plain weight")]
    best = {(label, grad): float("inf") for label, _, _ in runs for grad in (False, True)}
    for _ in range(rounds):
        for label, fn, once in runs:
            with nf4_torchao.dequantized_once() if once else contextlib.nullcontext():
                assert torch.equal(fn(x), recipes["plain weight"](x)), label
                for grad in (False, True):
                    i = x.clone().requires_grad_(grad)
                    with torch.set_grad_enabled(grad):
                        fn(i)
                        sync()
                        started = time.perf_counter()
                        for _ in range(calls):
                            fn(i)
                        sync()
                    best[label, grad] = min(best[label, grad], (time.perf_counter() - started) / calls * 1e6)
    return [{"recipe": label, "no_grad_us": round(best[label, False], 2), "grad_us": round(best[label, True], 2)}
            for label, _, _ in runs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeat", type=int, default=10)
    args = parser.parse_args()
    tunables = worker_malloc_env(args.device)  # read by glibc when a process starts: restart with them
    if tunables:
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **tunables})
    torch.set_num_threads(1)
    malloc = tune_malloc() if args.device == "cpu" else None
    device = torch.device(args.device)
    module = nf4_torchao.nf4_module()
    recipes = {"torchao": module.NF4Tensor._torchao_get_original_weight, "pair rows": pair_rows,
               "pair ints": nf4_torchao.dequantize}
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for shape_name, shape in SHAPES.items():
            weight = quantize_whole(torch.randn(*shape, dtype=dtype, device=device))  # as training's
            reference = recipes["torchao"](weight)
            for name, fn in recipes.items():
                assert torch.equal(fn(weight), reference), f"{name} differs from torchao ({shape_name}, {dtype})"
            times = {name: seconds(fn, weight, args.repeat, device) for name, fn in recipes.items()}
            rows.append({"shape": shape_name, "rows": shape[0], "cols": shape[1], "dtype": str(dtype).split(".")[1],
                         "ms": {k: round(v * 1e3, 3) for k, v in times.items()},
                         "ratio_to_torchao": {k: round(v / times["torchao"], 3) for k, v in times.items()},
                         "ns_per_weight": {k: round(v * 1e9 / weight.numel(), 3) for k, v in times.items()}})
    head = f"{'weight':<12} {'dtype':<9}" + "".join(f" {n + ' ms':>13}" for n in recipes) + \
        "".join(f" {n + '/torchao':>18}" for n in list(recipes)[1:])
    print(head)
    for r in rows:
        print(f"{r['shape']:<12} {r['dtype']:<9}" + "".join(f" {r['ms'][n]:>13.2f}" for n in recipes) +
              "".join(f" {r['ratio_to_torchao'][n]:>18.3f}" for n in list(recipes)[1:]))
    calls = call_rows(module, device)
    print(f"\n{'one F.linear call, 1 token':<44} {'no grad us':>10} {'grad us':>8}")
    for r in calls:
        print(f"{r['recipe']:<44} {r['no_grad_us']:>10.1f} {r['grad_us']:>8.1f}")
    result = {"bench": "nf4-dequant", "device": str(device), "malloc": malloc,
              "glibc_tunables": os.environ.get("GLIBC_TUNABLES"), "repeat": args.repeat, "threads": 1,
              "rows": rows, "calls": calls, **run_record()}
    suffix = "" if device.type == "cpu" else f"-{device.type}"
    (HERE / "results" / f"nf4-dequant{suffix}.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
