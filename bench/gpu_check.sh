#!/usr/bin/env bash
# The GPU check: every feature once, on one GPU machine, under one overall `timeout` (--limit, 10 minutes;
# --quick: 8) and `--collective-timeout 60`. Each row prints `PASS row  numbers` or `FAIL row: why` (or
# `SKIP row: why` where a piece of the machine is missing, `NOT RUN row: why` where it was not started);
# the exit code is 1 if any row failed (124: the whole check ran past its limit; the row it was in is
# a failed row). Results: bench/results/gpu_check.json, a JSON list of rows stamped with commit and date
# ($GPU_CHECK_SUMMARY names another file; the CPU smoke writes its own under $CACHE).
#
#   bash bench/gpu_check.sh              # everything (tiny and 1.1B models)
#   bash bench/gpu_check.sh --quick      # tiny-model rows only, a first look
#   bash bench/gpu_check.sh --pending    # only the rows the results file does not hold as passed
#   bash bench/gpu_check.sh --list       # the rows;  --only ROW,ROW  runs some of them
#   bash bench/gpu_check.sh --dry-run    # print each row's commands, run nothing (works anywhere)
#   bash bench/gpu_check.sh --cpu-smoke  # the tiny rows on this machine's CPU: checks the script itself
#   --with-tests: also the pytest rows marked gpu (tests/test_gpu.py);  --limit SECONDS: the overall limit
#
# Budget: a row is started only if the time spent plus its estimated cost (ROW_S_TINY, ROW_S_BIG below)
# stays within --limit; else it is recorded as not run (`passed: null`, "not run: budget") rather than
# killed in its middle. `--dry-run --limit S` shows which rows would fit S. --pending runs the rows of the
# results file (of the full list, or of --only) recorded as failed or not run first, then those it does
# not hold, and merges the new verdicts into the file: a row judged again replaces its entry, the others
# keep theirs. A row that uses another's adapter (eval, generate, harness: sft-val; eval-nf4: nf4) or run
# (long-offload: long-context's losses) brings that row along when its adapter is not in $CACHE. The 1.1B
# model is prepared only for a row using it.
#
# One borrowed GPU session (15 minutes of device time, each tiny row ~45 s, a machine start 1-2 min) gets
# through part of the list; every session runs, in one `run` of timeout_s ~540 carrying `.whl`:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site
#     .whl/*.whl && export PYTHONPATH=/tmp/site || exit; GPU_CHECK_COMMIT=<git rev-parse --short HEAD here>
#     bash bench/gpu_check.sh --pending --limit 480; cp bench/results/gpu_check.json $OUT/
# and copies the returned gpu_check.json over bench/results/gpu_check.json (docs/development.md, GPU checks).
#
# Ranks: with 2+ GPUs the fine-tunes run 2 NCCL ranks (one per GPU). On one GPU they run one rank (an
# NCCL group of one): NCCL refuses two ranks on one GPU and shardtune has no gloo-over-CUDA mode, so
# the row `two-ranks-one-gpu` checks that the refusal comes as a clear error before anything starts.
# `env` prints which mode applied. Installs nothing: torch and transformers are the machine's; peft and
# torchao, where the machine lacks them (the H200 image: torchao, lm_eval, flash_attn), travel as wheels.
#
# Rows (eval, eval-nf4, generate and harness use the adapters of sft-val and nf4): env, sft-val, fp16, dtype-auto, nf4, dpo-precomputed, orpo-dora, simpo-packed, varlen (flash-attn
# packing, when flash_attn is installed), eval, eval-nf4, generate, harness (when lm_eval is installed),
# torchrun, two-ranks-one-gpu; and on the 1.1B model a planner row per strategy (plan-fsdp2, plan-fsdp1,
# plan-ddp, plan-single: the whole planned peak against torch's max reserved memory plus what the GPU
# holds outside it, from mem_get_info), offload, ac, nf4-big, auto-limit (the automatic choice with only
# 8 GiB of the GPU left free by a ballast process: the choice must fit what mem_get_info reports); then
# long-context, long-offload, context-parallel (2 GPUs), grpo, grpo-nf4, vllm-sync (a real vLLM server as
# GRPO's generator, synced by the adapter alone: when vllm is installed) and tests (--with-tests).
set -uo pipefail
cd "$(dirname "$0")/.."
ARGS=("$@")
QUICK=0 ONLY="" LIST=0 DRY=0 CPU=0 TESTS=0 LIMIT="" PENDING=0
while [ $# -gt 0 ]; do
  case $1 in
    --quick) QUICK=1 ;;
    --pending) PENDING=1 ;;
    --only) ONLY=${2:?--only needs ROW,ROW}; shift ;;
    --list) LIST=1 ;;
    --dry-run) DRY=1 ;;
    --cpu-smoke) CPU=1 QUICK=1 ;;
    --with-tests) TESTS=1 ;;
    --limit) LIMIT=${2:?--limit needs seconds}; shift ;;
    -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu_check.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
LIMIT_SET=$([ -n "$LIMIT" ] && echo 1 || echo 0)
[ $QUICK = 1 ] && LIMIT=${LIMIT:-480} || LIMIT=${LIMIT:-600}
[[ $LIMIT =~ ^[0-9]+$ ]] || { echo "gpu_check.sh: --limit takes whole seconds, not $LIMIT" >&2; exit 2; }

QUICK_ROWS="env sft-val fp16 dtype-auto nf4 dpo-precomputed eval generate torchrun two-ranks-one-gpu"
ALL_ROWS="env sft-val fp16 dtype-auto nf4 dpo-precomputed orpo-dora simpo-packed varlen eval eval-nf4 generate
harness torchrun two-ranks-one-gpu plan-fsdp2 plan-fsdp1 plan-ddp plan-single offload ac nf4-big auto-limit
long-context long-offload context-parallel grpo grpo-nf4 vllm-sync tests"
# The rows on the 1.1B model; the others use the tiny one.
BIG_ROWS="plan-fsdp2 plan-fsdp1 plan-ddp plan-single offload ac nf4-big auto-limit long-context long-offload"
# A row's cost in wall time, for the budget. Measured on the H200 (torch 2.11, one GPU) on 2026-12-04:
# a tiny-model row took 40-47 s (8 steps train in ~4 s; the rest is process start, imports, CUDA/NCCL
# init). ROW_S_BIG is an estimate for the 1.1B rows (none had finished there yet): adjust once they have.
ROW_S_TINY=50
ROW_S_BIG=120
ROWS=$([ $QUICK = 1 ] && [ -z "$ONLY" ] && echo $QUICK_ROWS || echo $ALL_ROWS)  # --only picks from all
for r in ${ONLY//,/ }; do
  [[ " $(echo $ALL_ROWS) " == *" $r "* ]] || { echo "gpu_check.sh: no row $r (see --list)" >&2; exit 2; }
done

CACHE=${CACHE:-/tmp/shardtune-gpu}
export GPU_CHECK_RESULTS=$CACHE/results.jsonl
# the CPU smoke checks the script, not a GPU: its rows stay out of bench/results
SUMMARY=$([ $CPU = 1 ] && echo "$CACHE/gpu_check-cpu-smoke.json" || echo bench/results/gpu_check.json)
SUMMARY=${GPU_CHECK_SUMMARY:-$SUMMARY}
PY=python3
CHECK="$PY bench/gpu_check.py"
COLLECT=("$GPU_CHECK_RESULTS" "$SUMMARY")
[ $PENDING = 1 ] && COLLECT+=(--merge --order "$(echo $ALL_ROWS | tr ' ' ,)")

want() { [ -z "$ONLY" ] || [[ ",$ONLY," == *",$1,"* ]]; }
PICK=$(for r in $ROWS; do want "$r" && echo "$r"; done)
if [ $PENDING = 1 ]; then PICK=$($CHECK pending "$SUMMARY" $PICK) || exit 2; fi
if [ $LIST = 1 ]; then [ -z "$PICK" ] || echo $PICK | tr ' ' '\n'; exit 0; fi
if [ -z "$(echo $PICK)" ]; then echo "nothing pending: $SUMMARY holds every row asked for as passed"; exit 0; fi

# One overall limit for everything below: timeout signals the whole process group (launchers, workers),
# and 20 s later kills what is left (exit 137). The rows judged before the limit are kept, the row cut
# off is a failed one, and the limit is one more failed row.
if [ -z "${GPU_CHECK_INNER:-}" ] && [ $DRY = 0 ]; then
  rm -f "$CACHE/current"
  GPU_CHECK_INNER=1 timeout --kill-after=20 "$LIMIT" bash "$0" "${ARGS[@]}"
  code=$?
  if [ $code = 124 ] || [ $code = 137 ]; then
    echo "FAIL gpu_check: the whole check ran past its ${LIMIT} s limit"
    mkdir -p "$CACHE"
    if [ -s "$CACHE/current" ]; then  # the row it was in the middle of
      echo "{\"row\": \"$(cat "$CACHE/current")\", \"passed\": false," \
        "\"problems\": [\"cut off by the overall ${LIMIT} s limit\"]}" >> "$GPU_CHECK_RESULTS"
    fi
    echo "{\"row\": \"gpu_check\", \"passed\": false, \"problems\": [\"ran past its ${LIMIT} s limit\"]}" \
      >> "$GPU_CHECK_RESULTS"
    $CHECK collect "${COLLECT[@]}"
  fi
  exit $code
fi

export PYTHONPATH="$PWD/src:${PYTHONPATH:-}"
RUNS=$CACHE/runs
DEV=cuda
[ $CPU = 1 ] && DEV=cpu
export GPU_CHECK_DEVICE=$DEV
mkdir -p "$RUNS" "$(dirname "$SUMMARY")"
rm -f "$GPU_CHECK_RESULTS"

# x LOG CMD...: run CMD with its output in LOG (on --dry-run: print it); its exit code
x() {
  local log=$1; shift
  if [ $DRY = 1 ]; then printf '  '; printf '%q ' "$@"; echo; return 0; fi
  "$@" > "$log" 2>&1
}
# xo LOG OUT CMD...: as x, with CMD's standard output in OUT
xo() {
  local log=$1 out=$2; shift 2
  if [ $DRY = 1 ]; then printf '  '; printf '%q ' "$@"; echo "> $out"; return 0; fi
  "$@" > "$out" 2> "$log"
}
fail() { echo "FAIL $1: $2"; [ -f "${3:-}" ] && tail -n 15 "$3" | sed 's/^/    /'
         echo "{\"row\": \"$1\", \"passed\": false, \"problems\": [\"$2\"]}" >> "$GPU_CHECK_RESULTS"; }
skip() { echo "SKIP $1: $2"; echo "{\"row\": \"$1\", \"passed\": true, \"skipped\": \"$2\"}" >> "$GPU_CHECK_RESULTS"; }
notrun() { echo "NOT RUN $1: $2"
           echo "{\"row\": \"$1\", \"passed\": null, \"problems\": [\"not run: $2\"]}" >> "$GPU_CHECK_RESULTS"; }
# why_not ROW: "skip WHY" where ROW does not apply to this machine (a pass), "notrun WHY" where it was not
# asked for; nothing where it runs
why_not() {
  case $1 in
    varlen) [ "$FLASH" = yes ] || echo "skip flash_attn is not installed here" ;;
    harness) [ "$LMEVAL" = yes ] || echo "skip lm_eval is not installed here" ;;
    vllm-sync) [ "$VLLM" = yes ] || echo "skip vllm is not installed here (its wheels are too large to carry)" ;;
    two-ranks-one-gpu) { [ "$N" -lt 2 ] && [ $DEV = cuda ]; } || echo "skip not one GPU here" ;;
    context-parallel) [ "$N" -ge 2 ] || echo "skip one GPU: --context-parallel 2 needs two" ;;
    tests) [ $TESTS = 1 ] || echo "notrun not asked for (--with-tests)" ;;
  esac
}
# needs ROW: the row whose adapter (or run, to compare with) ROW uses
needs() { case $1 in eval|generate|harness) echo sft-val ;; eval-nf4) echo nf4 ;; long-offload) echo long-context ;; esac; }
# cost ROW: its estimated wall time in seconds
cost() {
  if [ "$1" = env ] || [ -n "$(why_not "$1")" ]; then echo 0
  elif [[ " $BIG_ROWS " == *" $1 "* ]]; then echo $ROW_S_BIG
  elif [ "$1" = vllm-sync ]; then echo $((ROW_S_TINY + 180))  # the server's start, a guess: none has run there
  else echo $ROW_S_TINY; fi
}

if [ $DRY = 1 ]; then
  N=1 CAP=9.0 FLASH=yes LMEVAL=yes VLLM=yes  # print every row's commands
else
  $CHECK env $([ $CPU = 1 ] && echo --allow-cpu) | tee "$CACHE/env.txt" || exit 1
  N=$([ $DEV = cuda ] && $PY -c "import torch; print(min(2, torch.cuda.device_count()))" || echo 1)
  CAP=$(awk '/^capability:/ {print $2}' "$CACHE/env.txt")
  FLASH=$(awk '/^flash_attn:/ {print $2}' "$CACHE/env.txt")
  LMEVAL=$(awk '/^lm_eval:/ {print $2}' "$CACHE/env.txt")
  VLLM=$(awk '/^vllm:/ {print $2}' "$CACHE/env.txt")
fi
# The rows to run: those picked, each after the row whose adapter it uses where that adapter is not here
SELECTED=" "
for r in $PICK; do
  p=$(needs "$r")
  if [ -n "$p" ] && [ -z "$(why_not "$r")" ] && [[ "$SELECTED" != *" $p "* ]] && [ ! -d "$RUNS/$p/adapter" ]; then
    SELECTED+="$p "
  fi
  [[ "$SELECTED" == *" $r "* ]] || SELECTED+="$r "
done
# The inputs; the 1.1B model (2.2 GB to write) only when the first row on it starts
if [ $DRY = 1 ]; then
  eval "$($CHECK prepare "$CACHE" --quick 2>/dev/null | sed 's/^/export /')" || true
  BIG=$CACHE/llama-1.1b
else
  eval "$($CHECK prepare "$CACHE" --quick 2> "$CACHE/prepare.log" | sed 's/^/export /')" \
    || { tail -n 20 "$CACHE/prepare.log"; exit 1; }
fi
big_model() {  # BIG, and BIG_RUN's --model (its 2nd word, "none" until now)
  [ -n "${BIG:-}" ] && return 0
  local lines
  lines=$($CHECK prepare "$CACHE" 2> "$CACHE/prepare-big.log") && eval "$(echo "$lines" | sed 's/^/export /')" \
    && [ -n "${BIG:-}" ] && BIG_RUN[1]=$BIG
}
# --dtype auto: bf16 from compute capability 8.0 (Ampere) on, fp16 before; fp32 on this CPU (smoke)
AUTO=$([ $DEV = cpu ] && echo fp32 || ([ "${CAP%%.*}" -ge 8 ] 2>/dev/null && echo bf16 || echo fp16))
DTYPE=$([ $DEV = cpu ] && echo fp32 || echo bf16)  # the CPU smoke: bf16 matmul crawls without AVX512-BF16
COMMON=(--device "$DEV" --collective-timeout 60 --seed 1 --overwrite)
# (no --nproc here: torchrun's own parser would take it for an abbreviation of its --nproc-per-node)
TINY_BASE=(--model "$TINY" --data "$DATA_SHORT" --seq-len 128 --batch-size $((4 * N)) --steps 8
           --lr 1e-2 --warmup-steps 1 --lora-r 8 --dtype "$DTYPE" "${COMMON[@]}")
TINY_RUN=("${TINY_BASE[@]}" --nproc "$N")
BIG_RUN=(--model "${BIG:-none}" --data "$DATA" --seq-len 512 --nproc "$N" --batch-size $((8 * N)) --steps 8
         --micro-batch-size 8 --lr 1e-3 --warmup-steps 1 --lora-targets q_proj,v_proj --dtype "$DTYPE" "${COMMON[@]}")

# A flag given again later wins (argparse), so rows change the runs above by appending flags.
# finetune ROW FLAGS... -- CHECK-FLAGS...: a fine-tune, then its verdict
finetune() {
  local row=$1; shift
  local flags=() checks=()
  while [ $# -gt 0 ] && [ "$1" != -- ]; do flags+=("$1"); shift; done
  [ $# -gt 0 ] && shift && checks=("$@")
  if ! x "$RUNS/$row.log" $PY -m shardtune finetune "${flags[@]}" --out "$RUNS/$row"; then
    fail "$row" "shardtune finetune exited non-zero" "$RUNS/$row.log"; return
  fi
  [ $DRY = 1 ] || $CHECK check "$row" --out "$RUNS/$row" --log "$RUNS/$row.log" "${checks[@]}"
}
# planned ROW FLAGS... -- CHECK-FLAGS...: as finetune, with `shardtune plan --json` of the same flags first
planned() {
  local row=$1; shift
  local flags=()
  while [ $# -gt 0 ] && [ "$1" != -- ]; do flags+=("$1"); shift; done
  local plan_flags=()
  for f in "${flags[@]}"; do [ "$f" != --overwrite ] && plan_flags+=("$f"); done
  if ! xo "$RUNS/$row.plan.log" "$RUNS/$row.plan.json" $PY -m shardtune plan "${plan_flags[@]}" --json; then
    fail "$row" "shardtune plan exited non-zero" "$RUNS/$row.plan.log"; return
  fi
  finetune "$row" "${flags[@]}" "$@" --plan "$RUNS/$row.plan.json"
}

row_env() { :; }  # printed above
row_sft-val() {
  finetune sft-val "${TINY_RUN[@]}" --strategy fsdp2 --val-data "$DATA_SHORT" --eval-every 4 \
    -- --expect strategy=fsdp2 --val --loss-down
}
row_fp16() {  # loss scaling: an overflow is a skipped step (metrics.jsonl counts them), never "diverged"
  finetune fp16 "${TINY_RUN[@]}" --dtype fp16 --strategy fsdp2 -- --expect dtype=fp16 --metric skipped_steps \
    --metric loss_scale --loss-down
}
row_dtype-auto() { finetune dtype-auto "${TINY_RUN[@]}" --dtype auto -- --expect "dtype=$AUTO"; }
row_nf4() { finetune nf4 "${TINY_RUN[@]}" --strategy fsdp2 --quantize nf4 -- --expect strategy=fsdp2 --expect quantize=nf4 --loss-down; }
row_dpo-precomputed() {
  finetune dpo-precomputed "${TINY_RUN[@]}" --data "$PAIRS" --objective dpo --precompute-reference \
    --val-data "$PAIRS_VAL" --strategy fsdp2 -- --val --metric "rewards/accuracies"
}
row_orpo-dora() {
  finetune orpo-dora "${TINY_RUN[@]}" --data "$PAIRS" --objective orpo --lora-variant dora --strategy fsdp2 \
    -- --expect lora_variant=dora
}
row_simpo-packed() {
  finetune simpo-packed "${TINY_RUN[@]}" --data "$PAIRS" --objective simpo --packing --strategy fsdp2 \
    -- --expect packing=true
}
row_varlen() {  # packed rows through flash-attention's variable-length kernel (cu_seq_lens)
  finetune varlen "${TINY_RUN[@]}" --model "$TINY_FLASH" --data "$DATA_MIXED" --seq-len 512 --packing --dtype bf16 \
    --strategy fsdp2 -- --expect packing=true --loss-down
}
row_eval() {
  xo "$RUNS/eval.log" "$RUNS/eval.json" $PY -m shardtune eval --model "$TINY" \
    --adapter "$RUNS/sft-val/adapter" --data "$DATA_SHORT" --dtype "$DTYPE" --max-new-tokens 8 --json \
    || { fail eval "shardtune eval exited non-zero" "$RUNS/eval.log"; return; }
  [ $DRY = 1 ] || $CHECK check-json eval "$RUNS/eval.json" --keys loss --keys perplexity
}
row_eval-nf4() {  # the 4-bit base built on the GPU weight by weight (tools/generate.py's load_quantized)
  xo "$RUNS/eval-nf4.log" "$RUNS/eval-nf4.json" $PY -m shardtune eval --model "$TINY" \
    --adapter "$RUNS/nf4/adapter" --data "$DATA_SHORT" --dtype "$DTYPE" --quantize nf4 --max-new-tokens 8 --json \
    || { fail eval-nf4 "shardtune eval --quantize nf4 exited non-zero" "$RUNS/eval-nf4.log"; return; }
  [ $DRY = 1 ] || $CHECK check-json eval-nf4 "$RUNS/eval-nf4.json" --keys loss
}
row_generate() {
  x "$RUNS/generate.log" $PY -m shardtune generate --model "$TINY" --adapter "$RUNS/sft-val/adapter" \
    --prompt "Name a color." --max-new-tokens 16 --dtype "$DTYPE" \
    || { fail generate "shardtune generate exited non-zero" "$RUNS/generate.log"; return; }
  [ $DRY = 1 ] || $CHECK check-json generate "$RUNS/generate.log"
}
row_harness() {  # lm-evaluation-harness on a local task (no dataset hub is reachable from the machine)
  x "$RUNS/harness.log" $PY -m shardtune eval --model "$TINY" --adapter "$RUNS/sft-val/adapter" \
    --tasks tiny_choice --include-path "$TASKS" --limit 8 --dtype "$DTYPE" --out "$RUNS/harness" \
    || { fail harness "shardtune eval --tasks exited non-zero" "$RUNS/harness.log"; return; }
  [ $DRY = 1 ] || $CHECK check-json harness "$RUNS/harness/lm_eval.json" --keys "results.adapter.tiny_choice.acc,none"
}
row_torchrun() {  # plain torchrun: every rank runs the command (its ranks replace --nproc); rank 0 plans for all
  x "$RUNS/torchrun.log" $PY -m torch.distributed.run --standalone --nproc-per-node "$N" -m shardtune finetune \
    "${TINY_BASE[@]}" --strategy fsdp2 --out "$RUNS/torchrun" \
    || { fail torchrun "torchrun exited non-zero" "$RUNS/torchrun.log"; return; }
  [ $DRY = 1 ] || $CHECK check torchrun --out "$RUNS/torchrun" --log "$RUNS/torchrun.log" --expect "world_size=$N" \
    --loss-down
}
row_two-ranks-one-gpu() {  # with one GPU: two ranks are refused before anything starts, saying why
  x "$RUNS/two.log" $PY -m shardtune finetune "${TINY_RUN[@]}" --nproc 2 --batch-size 8 --out "$RUNS/two"
  local code=$?
  [ $DRY = 1 ] && return
  if [ $code = 2 ] && grep -q "NCCL needs one GPU per rank" "$RUNS/two.log"; then
    echo "PASS two-ranks-one-gpu  exit 2, said: $(grep -o "[0-9]* ranks on this node but [0-9]* GPU(s) visible" "$RUNS/two.log")"
    echo '{"row": "two-ranks-one-gpu", "passed": true}' >> "$GPU_CHECK_RESULTS"
  else
    fail two-ranks-one-gpu "expected exit 2 naming NCCL's one GPU per rank, got exit $code" "$RUNS/two.log"
  fi
}
# The planner on a 1.1B model: per strategy, the whole peak (CUDA context and NCCL included) planned
# against the measured one: torch's max reserved plus the memory the GPU holds outside torch.
row_plan-fsdp2() { planned plan-fsdp2 "${BIG_RUN[@]}" --strategy fsdp2 --fsdp-unit layer -- --loss-down; }
row_plan-fsdp1() { planned plan-fsdp1 "${BIG_RUN[@]}" --strategy fsdp1 -- --loss-down; }
row_plan-ddp() { planned plan-ddp "${BIG_RUN[@]}" --strategy ddp -- --loss-down; }
row_plan-single() {
  planned plan-single "${BIG_RUN[@]}" --nproc 1 --batch-size 8 --strategy single -- --loss-down
}
row_offload() { planned offload "${BIG_RUN[@]}" --strategy fsdp2 --fsdp-unit layer --cpu-offload -- --loss-down; }
row_ac() { planned ac "${BIG_RUN[@]}" --strategy fsdp2 --fsdp-unit layer --activation-checkpointing -- --loss-down; }
row_nf4-big() { planned nf4-big "${BIG_RUN[@]}" --strategy fsdp2 --quantize nf4 -- --loss-down; }
row_auto-limit() {  # the automatic choice against the device's real limit: a ballast leaves 8 GiB free
  local leave=8 ready=$CACHE/ballast.ready
  if [ $DRY = 1 ]; then echo "  $CHECK ballast --leave $leave --ready $ready &"; else
    rm -f "$ready"; $CHECK ballast --leave $leave --ready "$ready" > "$RUNS/ballast.log" 2>&1 &
    local ballast=$!
    for _ in $(seq 60); do [ -f "$ready" ] && break; sleep 1; done
  fi
  finetune auto-limit "${BIG_RUN[@]}" --micro-batch-size auto --strategy auto -- --budget-gib $leave --loss-down
  [ $DRY = 1 ] || kill "$ballast" 2>/dev/null
}
# Long context on the 1.1B model: packed rows of 16k tokens, the loss head in chunks, MLPs tiled where the
# planner says so; then with the checkpointed layer inputs in pinned host memory (a side stream on CUDA)
LONG_RUN=(--seq-len 16384 --packing --micro-batch-size 1 --batch-size "$N" --strategy fsdp2 --activation-checkpointing)
row_long-context() { planned long-context "${BIG_RUN[@]}" "${LONG_RUN[@]}" -- --expect activation_offload=False; }
row_long-offload() {  # where the layer inputs wait changes nothing else: long-context's losses and gradients
  planned long-offload "${BIG_RUN[@]}" "${LONG_RUN[@]}" --activation-offload -- --expect activation_offload=True \
    --same-as "$RUNS/long-context"
}
row_context-parallel() {  # the sequence cut over two GPUs: NCCL's all-to-all
  finetune context-parallel "${TINY_RUN[@]}" --strategy fsdp2 --context-parallel 2 -- --expect context_parallel=2
}
# GRPO on the tiny model: generation on the GPU with the weights gathered, rewards from a Python file
GRPO_RUN=(--data examples/arithmetic_train.jsonl --objective grpo --reward examples/grpo_rewards.py:correct_answer
          --reward examples/grpo_rewards.py:number_only --num-generations 4 --batch-size $((4 * N))
          --max-completion-length 16 --strategy fsdp2)
row_grpo() { finetune grpo "${TINY_RUN[@]}" "${GRPO_RUN[@]}" -- --metric reward --expect objective=grpo; }
row_grpo-nf4() {
  finetune grpo-nf4 "${TINY_RUN[@]}" "${GRPO_RUN[@]}" --quantize nf4 -- --metric reward --expect quantize=nf4
}
# A real vLLM server as GRPO's generator on the same GPU: the adapter alone synced after every step, each
# version checked as served from its folder (the run stops non-zero otherwise), vLLM's log-probs for the
# importance-sampling correction (tests/test_grpo_vllm.py runs the same protocol against a stub on CPU)
VLLM_PORT=${VLLM_PORT:-8011}
row_vllm-sync() {
  local log=$RUNS/vllm-server.log server=
  if [ $DRY = 1 ]; then echo "  VLLM_ALLOW_RUNTIME_LORA_UPDATING=True $PY -m vllm.entrypoints.openai.api_server --model $TINY \
--enable-lora --max-lora-rank 8 --port $VLLM_PORT --gpu-memory-utilization 0.3 &"; else
    VLLM_ALLOW_RUNTIME_LORA_UPDATING=True $PY -m vllm.entrypoints.openai.api_server --model "$TINY" --enable-lora \
      --max-lora-rank 8 --port "$VLLM_PORT" --gpu-memory-utilization 0.3 > "$log" 2>&1 &
    server=$!
    for _ in $(seq 180); do
      $PY -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$VLLM_PORT/v1/models', timeout=2)" 2>/dev/null && break
      kill -0 "$server" 2>/dev/null || break
      sleep 1
    done
  fi
  finetune vllm-sync "${TINY_RUN[@]}" "${GRPO_RUN[@]}" --steps 3 --vllm-url "http://127.0.0.1:$VLLM_PORT" \
    -- --metric reward --metric "sampling/importance_sampling_ratio/mean" --expect objective=grpo
  [ -z "$server" ] || kill "$server" 2>/dev/null
}
row_tests() {  # the pytest rows that ask for CUDA (two-GPU ones skip on one GPU, saying why)
  x "$RUNS/tests.log" $PY -m pytest -q -rs -p no:cacheprovider tests/test_gpu.py \
    && { echo "PASS tests  $(tail -n 1 "$RUNS/tests.log")"; echo '{"row": "tests", "passed": true}' >> "$GPU_CHECK_RESULTS"; } \
    || fail tests "pytest -m gpu failed" "$RUNS/tests.log"
}

# The budget: a row starts only when the time spent (the dry run: the estimates so far; it keeps to the
# budget only when --limit is given) plus its cost stays within the limit
START=$SECONDS SPENT=0
BUDGET=$([ $DRY = 0 ] || [ $LIMIT_SET = 1 ] && echo 1 || echo 0)
for row in $SELECTED; do
  [ $DRY = 1 ] && echo "row $row:"
  why=$(why_not "$row")
  if [ -n "$why" ]; then "${why%% *}" "$row" "${why#* }"; continue; fi
  c=$(cost "$row")
  now=$([ $DRY = 1 ] && echo $SPENT || echo $SECONDS)
  if [ $BUDGET = 1 ] && [ $((now + c)) -gt "$LIMIT" ]; then
    notrun "$row" "budget (~$c s needed, $((LIMIT - now)) s left of the $LIMIT s limit)"; continue
  fi
  SPENT=$((SPENT + c))
  t=$SECONDS
  [ $DRY = 1 ] || echo "$row" > "$CACHE/current"
  if [[ " $BIG_ROWS " == *" $row "* ]] && ! big_model; then
    fail "$row" "preparing the 1.1B model failed" "$CACHE/prepare-big.log"; continue
  fi
  "row_$row"
  [ $DRY = 1 ] || echo "      ($row: $((SECONDS - t)) s)"
done
rm -f "$CACHE/current"
[ $DRY = 1 ] && exit 0
echo "all rows: $((SECONDS - START)) s"
$CHECK collect "${COLLECT[@]}"
