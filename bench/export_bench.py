"""GGUF export vs merge on a random Llama checkpoint: peak memory, seconds per GB, file size per quant.

Each command runs as its own process (``python -m shardtune …``), and its peak resident memory is that
process's own ``ru_maxrss`` (``os.wait4``), so the numbers are what a user's run would show. The
checkpoint is bench/fake_model.py's (bf16, Hub layout); the adapter is a random rank-16 LoRA on
q/k/v/o of every layer, made here.

    nice -n 19 python bench/export_bench.py --size 1.1b        # writes bench/results/export-1.1b.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fake_model import SIZES, make_checkpoint  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def make_adapter(path: Path, size: str, rank: int = 16) -> Path:
    from safetensors.torch import save_file

    s = SIZES[size]
    head_dim = s.hidden // s.heads
    outs = {"q_proj": s.hidden, "k_proj": s.kv_heads * head_dim, "v_proj": s.kv_heads * head_dim, "o_proj": s.hidden}
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for layer in range(s.layers):
        for name, out in outs.items():
            key = f"base_model.model.model.layers.{layer}.self_attn.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, s.hidden, generator=g) * 0.01
            tensors[f"{key}.lora_B.weight"] = torch.randn(out, rank, generator=g) * 0.01
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(outs),
        "task_type": "CAUSAL_LM"}))
    return path


def run(args: list[str]) -> dict:
    """Run ``python -m shardtune ARGS``; its wall seconds and its own peak RSS."""
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "shardtune", *args], stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"shardtune {' '.join(args)} failed")
    return {"seconds": round(time.perf_counter() - start, 2), "peak_rss_mb": round(usage.ru_maxrss / 1024, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="1.1b")
    parser.add_argument("--cache", type=Path, default=Path("/tmp/shardtune-bench"))
    parser.add_argument("--quants", default="f16,bf16,q8_0")
    args = parser.parse_args()
    model = make_checkpoint(args.size, args.cache)
    adapter = make_adapter(args.cache / f"adapter-{args.size}", args.size)
    model_bytes = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    out = args.cache / f"out-{args.size}"
    out.mkdir(exist_ok=True)
    result = {"size": args.size, "model_bytes": model_bytes, "checkpoint_dtype": "bf16", "cpus": os.cpu_count(),
              "merge": run(["merge", "--model", str(model), "--adapter", str(adapter), "--out", str(out / "merged"),
                            "--overwrite"]), "export": {}}
    for quant in args.quants.split(","):
        gguf = out / f"model-{quant}.gguf"
        r = run(["export", "--model", str(model), "--adapter", str(adapter), "--out", str(gguf), "--quant", quant,
                 "--force"])
        r["file_bytes"] = gguf.stat().st_size
        r["seconds_per_gb_read"] = round(r["seconds"] / (model_bytes / 1e9), 2)
        result["export"][quant] = r
        gguf.unlink()
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"export-{args.size}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
