"""GGUF export vs merge on a random Llama checkpoint: peak memory, seconds per GB, file size per quant.

Each command runs as its own process (``python -m shardtune …``), and two peaks are recorded for it:
its own ``ru_maxrss`` (``os.wait4``), what ``time -v`` or top show a user, which counts the touched
pages of the memory-mapped safetensors files too; and its private memory (RssAnon + RssShmem from
/proc/PID/status, sampled every few milliseconds from here), what it allocates itself. Merge and
export are compared on both. The checkpoint is bench/fake_model.py's (bf16, Hub layout); the adapter
is a random rank-16 LoRA on q/k/v/o of every layer, made here. The record says the machine, whether
its CPU converts bf16 natively (an AVX2-only CPU does it in software, slowly) and the load average
when the bench started.

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
from record import run_record  # noqa: E402

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


def _status_kb(pid: int) -> dict[str, int]:
    """RssAnon, RssShmem and RssFile of ``pid`` in KiB (empty once it has exited)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return {k: int(v.split()[0]) for k, _, v in (line.partition(":") for line in f)
                    if k in ("RssAnon", "RssShmem", "RssFile")}
    except OSError:
        return {}


def run(args: list[str], every: float = 0.005) -> dict:
    """Run ``python -m shardtune ARGS``: wall seconds, ru_maxrss, sampled peak private memory, its stdout."""
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "shardtune", *args], stdout=subprocess.PIPE, text=True)
    private_kb = file_kb = 0
    pid = 0
    while not pid:  # poll instead of wait: the samples are taken while it runs
        kb = _status_kb(proc.pid)
        private_kb = max(private_kb, kb.get("RssAnon", 0) + kb.get("RssShmem", 0))
        file_kb = max(file_kb, kb.get("RssFile", 0))
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if not pid:
            time.sleep(every)
    stdout = proc.stdout.read()
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"shardtune {' '.join(args)} failed")
    return {"seconds": round(time.perf_counter() - start, 2), "peak_rss_mb": round(usage.ru_maxrss / 1024, 1),
            "peak_private_mb": round(private_kb / 1024, 1), "peak_file_pages_mb": round(file_kb / 1024, 1),
            "stdout": stdout}


def bf16_native() -> bool:
    """Whether oneDNN has native bf16 on this CPU (AVX512-BF16/AMX); without it bf16 conversion is emulated."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def per_gb(seconds: float, n_bytes: int) -> float:
    return round(seconds / (n_bytes / 1e9), 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="1.1b")
    parser.add_argument("--cache", type=Path, default=Path("/tmp/shardtune-bench"))
    parser.add_argument("--quants", default="f16,bf16,q8_0")
    args = parser.parse_args()
    loadavg = Path("/proc/loadavg").read_text().split()[:3]
    model = make_checkpoint(args.size, args.cache)
    adapter = make_adapter(args.cache / f"adapter-{args.size}", args.size)
    model_bytes = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    out = args.cache / f"out-{args.size}"
    out.mkdir(exist_ok=True)
    merge = run(["merge", "--model", str(model), "--adapter", str(adapter), "--out", str(out / "merged"),
                 "--overwrite"])
    del merge["stdout"]
    merge["seconds_per_gb_read"] = per_gb(merge["seconds"], model_bytes)
    result = {"size": args.size, "model_bytes": model_bytes, "checkpoint_dtype": "bf16", "cpus": os.cpu_count(),
              "bf16_native": bf16_native(), "loadavg_at_start": loadavg, "merge": merge, "export": {}}
    for quant in args.quants.split(","):
        gguf = out / f"model-{quant}.gguf"
        r = run(["export", "--model", str(model), "--adapter", str(adapter), "--out", str(gguf), "--quant", quant,
                 "--force", "--json"])
        r["write_seconds"] = json.loads(r.pop("stdout"))["seconds"]  # export's own timing: read, convert, write
        r["file_bytes"] = gguf.stat().st_size
        r["seconds_per_gb_read"] = per_gb(r["seconds"], model_bytes)
        r["write_seconds_per_gb_read"] = per_gb(r["write_seconds"], model_bytes)
        result["export"][quant] = r
        gguf.unlink()
    result["note"] = ("peak_rss_mb: the command's own ru_maxrss (os.wait4), anonymous memory plus the touched pages "
                      "of the memory-mapped safetensors files; peak_private_mb: RssAnon + RssShmem, sampled every "
                      "5 ms; seconds: the whole command (interpreter start and imports included), write_seconds: "
                      "export's own reading, converting and writing; random bf16 Llama (bench/fake_model.py), "
                      "rank-16 LoRA on q/k/v/o")
    result.update(run_record())
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"export-{args.size}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
