#!/usr/bin/env bash
# The GPU check, one short script for a lent GPU machine: a LoRA fine-tune of a random-weight
# 1.1B Llama-shape model (bf16, NCCL, one rank per GPU) with shardtune, then the same on FSDP1,
# printing per-rank peak memory (CUDA max allocated) and tokens/s. It uses the machine's own
# torch/transformers/peft (nothing is installed there). About 3 minutes on one H200.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src:${PYTHONPATH:-}"
CACHE=${CACHE:-/tmp/shardtune-gpu}
NGPU=$(python3 -c "import torch; print(max(1, torch.cuda.device_count()))")
python3 -c "import torch; assert torch.cuda.is_available(), 'no GPU visible'; print(torch.__version__, torch.cuda.get_device_name(0))"
MODEL=$(python3 -c "
import sys; sys.path.insert(0, 'bench')
from pathlib import Path
from fake_model import make_checkpoint, make_data
print(make_checkpoint('1.1b', Path('$CACHE')))
make_data(Path('$CACHE') / 'data-512.jsonl', n=256, seq_len=512)
from speed import mixed_data
mixed_data(Path('$CACHE') / 'data-mixed.jsonl', n=256)
" | tail -n1)
# fsdp2 and fsdp1 on full 512-token records; then padded and packed runs on mixed-length records
# (16..512 tokens, median ~100: bench/speed.py), where tokens/s counts real tokens only.
for run in fsdp2 fsdp1 fsdp2-padded fsdp2-packed; do
  strategy=${run%%-*}
  case $run in
    *-padded) data="$CACHE/data-mixed.jsonl"; extra=(--micro-batch-size 8 --batch-size $((8 * NGPU)));;
    *-packed) data="$CACHE/data-mixed.jsonl"; extra=(--micro-batch-size 8 --batch-size $((8 * NGPU)) --packing);;
    *) data="$CACHE/data-512.jsonl"; extra=(--batch-size 8);;
  esac
  python3 -m shardtune finetune --model "$MODEL" --data "$data" --out "$CACHE/run-$run" \
    --nproc "$NGPU" --strategy "$strategy" --dtype bf16 --steps 12 --seq-len 512 "${extra[@]}" \
    --lora-targets q_proj,v_proj > "$CACHE/$run.log" 2>&1 || { tail -n 30 "$CACHE/$run.log"; exit 1; }
  python3 - "$CACHE/run-$run/summary.json" "$run" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
print(f"{sys.argv[2]:13} ranks {s['world_size']}  real tokens/s {s['tokens_per_second']:.0f}  "
      f"fill {s.get('fill_ratio') or 0:.2f}  "
      f"load peak MB {s['load_peak_mb']}  train peak MB {s['train_peak_mb']}  load s {s['load_seconds']}  "
      f"loss {s['train_loss_first']:.3f} -> {s['train_loss_last']:.3f}")
PY
done
