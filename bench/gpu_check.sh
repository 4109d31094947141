#!/usr/bin/env bash
# The GPU check, one short script for a lent GPU machine; it ASSERTS (exit code != 0 on any failure).
#   1. the GPU-marked tests (tests/test_gpu.py: 1-rank NCCL fsdp2, bf16, CPU offload, resume, planner vs
#      reserved; the 2-rank ones skip, saying why, on a one-GPU machine) and the device tests;
#   2. a LoRA fine-tune of a random-weight 1.1B Llama-shape model (bf16, NCCL, one rank per GPU) on
#      fsdp2, fsdp2 --cpu-offload and fsdp1, each asserted: NCCL, the loss goes down, finite numbers,
#      CUDA peaks in summary.json, the planner's prediction within PLAN_BAND of max_memory_reserved.
# Prints one line per run and writes bench/results/gpu_check.json. Uses the machine's own torch/
# transformers/peft (nothing is installed there). About 4 minutes on one H200.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src:${PYTHONPATH:-}"
CACHE=${CACHE:-/tmp/shardtune-gpu}
STEPS=${STEPS:-12}
PLAN_BAND=${PLAN_BAND:-0.25}   # |predicted - reserved| / reserved must stay below this
mkdir -p "$CACHE" bench/results
python3 -c "import torch; assert torch.cuda.is_available(), 'no GPU visible'; print(torch.__version__, torch.cuda.get_device_name(0))"
NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")

if [ "${SKIP_TESTS:-0}" != 1 ]; then
  python3 -m pytest -q -rs tests/test_gpu.py tests/test_device.py -p no:cacheprovider
fi

MODEL=$(python3 -c "
import sys; sys.path.insert(0, 'bench')
from pathlib import Path
from fake_model import make_checkpoint, make_data
print(make_checkpoint('1.1b', Path('$CACHE')))
make_data(Path('$CACHE') / 'data-512.jsonl', n=256, seq_len=512)
from speed import mixed_data
mixed_data(Path('$CACHE') / 'data-mixed.jsonl', n=256)
" | tail -n1)
rm -f "$CACHE/results.jsonl"
run() {  # NAME, then extra flags
  local name=$1; shift
  local flags=(--model "$MODEL" --data "$CACHE/data-512.jsonl" --nproc "$NGPU" --device cuda --dtype bf16
               --batch-size 8 --seq-len 512 --lora-targets q_proj,v_proj "$@")
  rm -rf "$CACHE/run-$name"
  python3 -m shardtune finetune "${flags[@]}" --out "$CACHE/run-$name" --steps "$STEPS" > "$CACHE/$name.log" 2>&1 \
    || { tail -n 30 "$CACHE/$name.log"; echo "FAIL: $name"; exit 1; }
  python3 -m shardtune plan "${flags[@]}" --json > "$CACHE/$name.plan.json"
  python3 - "$name" "$CACHE/run-$name/summary.json" "$CACHE/$name.plan.json" "$PLAN_BAND" "$CACHE/results.jsonl" <<'PY'
import json, math, sys
name, summary, plan, band, results = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4]), sys.argv[5]
s, p = json.load(open(summary)), json.load(open(plan))
first = p[s["strategy"]]
pred = next(x for x in [first, *first["variants"]] if x["cpu_offload"] == ("offload" in name)
            and not x["activation_checkpointing"])
predicted = pred["peak_mb"] - pred["terms"]["runtime"]  # the CUDA context is not in torch's counters
reserved = max(s["cuda_max_reserved_mb"]["train"])
allocated = max(s["cuda_max_allocated_mb"]["train"])
row = {"run": name, "strategy": s["strategy"], "ranks": s["world_size"], "backend": s["backend"],
       "tokens_per_second": s["tokens_per_second"], "fill_ratio": s.get("fill_ratio"), "loss_first": s["train_loss_first"],
       "loss_last": s["train_loss_last"], "train_max_allocated_mb": allocated, "train_max_reserved_mb": reserved,
       "load_max_reserved_mb": max(s["cuda_max_reserved_mb"]["load"]), "predicted_mb": round(predicted, 1),
       "predicted_over_reserved": round(predicted / reserved, 3), "load_seconds": s["load_seconds"]}
print("  ".join(f"{k} {v}" for k, v in row.items()))
open(results, "a").write(json.dumps(row) + "\n")
problems = []
if s["device"] != "cuda" or "nccl" not in s["backend"]:
    problems.append(f"ran on {s['device']}/{s['backend']}, not CUDA/NCCL")
if not all(math.isfinite(x) for x in (s["train_loss_first"], s["train_loss_last"])):
    problems.append("loss not finite")
elif not s["train_loss_last"] < s["train_loss_first"]:
    problems.append(f"loss did not go down: {s['train_loss_first']} -> {s['train_loss_last']}")
if not 0 < allocated <= reserved:
    problems.append(f"CUDA peaks missing or inconsistent: allocated {allocated}, reserved {reserved}")
if abs(predicted - reserved) > band * reserved:
    problems.append(f"planner predicted {predicted:.0f} MB, max reserved {reserved:.0f} MB (band {band:.0%})")
if problems:
    sys.exit(f"FAIL {name}: " + "; ".join(problems))
PY
}
run fsdp2 --strategy fsdp2
run fsdp2-offload --strategy fsdp2 --cpu-offload
run fsdp1 --strategy fsdp1
# mixed-length records (16..512 tokens, median ~100: bench/speed.py), padded and packed; tokens/s counts real tokens
run fsdp2-padded --strategy fsdp2 --data "$CACHE/data-mixed.jsonl" --micro-batch-size 8 --batch-size $((8 * NGPU))
run fsdp2-packed --strategy fsdp2 --data "$CACHE/data-mixed.jsonl" --micro-batch-size 8 --batch-size $((8 * NGPU)) --packing
python3 -c "
import json; rows = [json.loads(l) for l in open('$CACHE/results.jsonl')]
json.dump(rows, open('bench/results/gpu_check.json', 'w'), indent=1); print('all GPU checks passed')"
