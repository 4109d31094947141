"""LoRA's fused forward (src/shardtune/model/lora_forward.py) against peft's own, side by side in one process.

    nice -n 10 python bench/lora_forward.py              # 30 layers (SmolLM2-135M's depth), 5 interleaved repeats
    nice -n 10 python bench/lora_forward.py --layers 4 --repeat 2

The model is bench/long_context.py's random Llama of SmolLM2-135M-Instruct's shape (hidden 576, MLP 1536, the
real 49,152-token vocabulary) with ``--layers`` decoder layers, fp32, LoRA r16 on every linear layer (B random,
so the adapter is not zero). Two phases, as GRPO runs them on each rank of bench/grpo_vs_trl.py: a training
step (4 rows of 64 tokens, forward and backward with activation checkpointing, the loss over the last 32
positions) and a generation (4 rows: a 32-token prompt, then 32 tokens one at a time with transformers' KV
cache, greedy). Rows: ``peft`` (peft's ``lora.Linear.forward``: base, A, B, product, sum) and ``fused``
(shardtune's: base, A, then B's matmul adding into the base output, ``torch.addmm``); the same model, its
layers' class switched between the two before each run, interleaved ``--repeat`` times.

Per row and phase: the median seconds and the minor page faults (each a fresh 4 KiB page: under the
allocator settings shardtune's CPU workers run with, runtime/cpu_tuning.py, every freed tensor of 128 KiB or
more goes back to the system, so each new output tensor faults its pages in again; on a GPU the caching
allocator has no such cost, and what remains there is the two kernels and their memory traffic saved per
projection). Ratios fused / peft. The vocabulary head's work is the same at any depth and the layers' grows
with it, so a shallow model's ratios are nearer 1 than a deep one's: the default is the real depth. Writes
bench/results/lora-forward.json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from record import run_record
from shardtune.runtime.cpu_tuning import worker_env

HERE = Path(__file__).resolve().parent
ROWS = ("peft", "fused")
ROWS_TOKENS, PROMPT, NEW = 4, 32, 32


def faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def child(args: argparse.Namespace) -> dict:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, DynamicCache

    from shardtune.model.lora_forward import fuse_lora_forward
    from shardtune.runtime.cpu_tuning import tune_malloc

    tune_malloc()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation="sdpa")
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.01)
    fuse_lora_forward(model)
    layers = [m for m in model.modules() if hasattr(m, "lora_A") and hasattr(m, "base_layer")]
    classes = {"fused": type(layers[0]), "peft": type(layers[0]).__bases__[0]}
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    ids = torch.randint(0, 49152, (ROWS_TOKENS, PROMPT + NEW))

    def train() -> None:
        model.train()
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=ids, logits_to_keep=NEW + 1).logits
        logits.log_softmax(-1)[:, :-1].gather(-1, ids[:, -NEW:, None]).mean().backward()

    def generate() -> None:
        model.eval()
        with torch.no_grad():
            cache = DynamicCache()
            out = model(input_ids=ids[:, :PROMPT], past_key_values=cache, use_cache=True)
            for _ in range(NEW):
                out = model(input_ids=out.logits[:, -1:].argmax(-1), past_key_values=cache, use_cache=True)

    runs: dict[str, dict[str, list]] = {row: {"train_s": [], "train_faults": [], "generate_s": [],
                                              "generate_faults": []} for row in ROWS}
    for _ in range(args.repeat + 1):  # the first round warms up both rows and is left out
        for row in ROWS:
            for layer in layers:
                layer.__class__ = classes[row]
            for phase, fn in (("train", train), ("generate", generate)):
                f, t = faults(), time.perf_counter()
                fn()
                runs[row][f"{phase}_s"].append(time.perf_counter() - t)
                runs[row][f"{phase}_faults"].append(faults() - f)
    return {row: {k: v[1:] for k, v in r.items()} for row, r in runs.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    from long_context import make_model

    args.model = make_model(args.layers, HERE / ".cache")
    # the environment a CPU worker of shardtune starts with: glibc's huge pages, one compute thread pool
    env = {**os.environ, **worker_env("cpu", 1)}
    out = subprocess.run([sys.executable, __file__, "--child", "--model", str(args.model), "--repeat",
                          str(args.repeat)], env=env, capture_output=True, text=True, check=True)
    runs = json.loads(out.stdout.strip().splitlines()[-1])
    rows = {row: {k: statistics.median(v) for k, v in r.items()} for row, r in runs.items()}
    ratios = {k: rows["fused"][k] / rows["peft"][k] for k in rows["peft"]}
    print(f"{'row':<8} {'train s':>8} {'train faults':>13} {'generate s':>11} {'generate faults':>16}")
    for row, r in [*rows.items(), ("fused/peft", ratios)]:
        print(f"{row:<8} {r['train_s']:8.3f} {r['train_faults']:13.3g} {r['generate_s']:11.3f} "
              f"{r['generate_faults']:16.3g}")
    result = {"model": f"SmolLM2-135M shape, {args.layers} layers, random", "layers": args.layers, "dtype": "fp32",
              "lora": {"r": 16, "alpha": 32}, "train_tokens": [ROWS_TOKENS, PROMPT + NEW],
              "generate": {"rows": ROWS_TOKENS, "prompt": PROMPT, "new": NEW}, "repeat": args.repeat,
              "allocator": "shardtune's CPU worker settings", "rows": rows, "ratios": ratios, "runs": runs,
              **run_record()}
    (HERE / "results" / "lora-forward.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
