"""Where one training step's time goes: torch.profiler over a step of shardtune on 2 ranks.

    .venv/bin/python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        bench/step_profile.py --size 1.1b --dtype fp32 --strategy fsdp2 --fsdp-unit part --seq-len 128

Uses a random Llama-shape checkpoint of bench/fake_model.py and fixed-length data (both made once under
bench/.cache). One warm-up step, then one profiled step. Rank 0 prints where the profiled step's wall
time went, by kind (matrix products, the rest of the model's operators, copies in and out of FSDP's
flat buffers, waiting on collectives, and the Python the profiler does not see: the step's wall time
less all operators' self time), then the operators with the most self time, and writes
bench/results/profile-<size>-<strategy>-<unit>-<micro>x<seq>[-glibc][-hugepages].json (-glibc: run with
SHARDTUNE_MALLOC=default, glibc's own allocator settings, instead of shardtune's mmap threshold;
-hugepages: run with GLIBC_TUNABLES=glibc.malloc.hugetlb=1, which shardtune's launcher sets and
torchrun does not; -gloo: FSDP2 gathering through gloo, SHARDTUNE_SHARED_GATHER=0, not shared memory).
Gloo's collectives run on its own threads: the main thread's time in them is its wait.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from pathlib import Path

import torch

from fake_model import SIZES, make_checkpoint, make_data
from record import run_record

HERE = Path(__file__).resolve().parent


KINDS = ("matrix products", "other operators", "copies (FSDP buffers, casts)", "FSDP hooks", "collectives (wait)")
# FSDP2 waits for a gather inside all_gather_copy_out (its copy is fsdp::split_with_sizes_copy), and for
# the gradients' reduce-scatter inside post_backward_reduce: those two are waits, not copies.
COLLECTIVE = ("c10d::", "FSDP::all_gather_copy_out", "FSDP::post_backward_reduce", "gloo", "record_param_comms")
MATMUL = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_scaled_dot_product", "aten::matmul",
          "aten::linear")
COPY = ("aten::copy_", "aten::cat", "aten::split_with_sizes_copy", "aten::_foreach_copy", "aten::clone",
        "aten::_to_copy", "aten::chunk_cat", "aten::empty", "fsdp::")


def kind_of(op: str) -> str:
    if op.startswith(COLLECTIVE):
        return "collectives (wait)"
    if op.startswith(COPY):
        return "copies (FSDP buffers, casts)"
    if op.startswith("FSDP::"):
        return "FSDP hooks"
    if op.startswith(MATMUL):
        return "matrix products"
    return "other operators"


def thread_cpu_seconds() -> dict[int, float]:
    """CPU seconds (user + system) each thread of this process has used so far, by thread id."""
    from shardtune.runtime.distributed import threads

    return {tid: cpu for tid, (_, _, cpu) in threads().items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", default="fsdp2")
    parser.add_argument("--fsdp-unit", default="part")
    parser.add_argument("--micro-batch-size", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--cache", type=Path, default=HERE / ".cache")
    parser.add_argument("--size", default="1.1b", choices=sorted(SIZES))
    parser.add_argument("--dtype", default="auto", choices=("auto", "bf16", "fp32"),
                        help="compute dtype (fp32 on CPUs without bf16 matmul, as --dtype auto decides)")
    args = parser.parse_args()
    torch.set_num_threads(1)  # as bench/peers.py: 2 ranks on 2 cores

    from shardtune.config import build_config
    from shardtune.runtime import distributed
    from shardtune.runtime.cpu_tuning import HUGE_PAGES, shared_gather_enabled, tune_malloc
    from shardtune.runtime.device import decide_dtype
    from shardtune.runtime.memory import MemoryMonitor
    from shardtune.train.job import setup

    malloc = tune_malloc()
    shared = shared_gather_enabled()  # FSDP2 gathers through shared memory (else gloo broadcasts)
    huge_pages = HUGE_PAGES in os.environ.get("GLIBC_TUNABLES", "")
    world = int(os.environ["WORLD_SIZE"])
    worker = distributed.init_worker()
    if worker.is_main:  # made once; the other rank waits at the barrier below
        make_checkpoint(args.size, args.cache)
        make_data(args.cache / f"data-{args.seq_len}.jsonl", seq_len=args.seq_len)
    torch.distributed.barrier()
    cfg = build_config({"model": str(args.cache / f"llama-{args.size}"),
                        "data": str(args.cache / f"data-{args.seq_len}.jsonl"),
                        "out": "/tmp/step-profile", "strategy": args.strategy, "fsdp-unit": args.fsdp_unit,
                        "batch-size": world * args.micro_batch_size, "micro-batch-size": args.micro_batch_size,
                        "seq-len": args.seq_len, "lora-targets": "q_proj,v_proj", "steps": 3, "dtype": args.dtype})
    cfg = decide_dtype(cfg)  # as preflight decides it before the workers start
    job = setup(cfg, worker, MemoryMonitor(worker.device))
    params = list(job.strategy.trainable(job.model).values())

    def step(i: int) -> float:
        started = time.perf_counter()
        job.step(i)
        for p in params:
            p.grad = None
        return time.perf_counter() - started

    warm = step(0)
    gather = getattr(job.strategy, "gather", None)  # FSDP2 on CPU; its waits if it is the shared-memory one
    waiting = dict(getattr(gather, "waiting_s", {}))
    before = thread_cpu_seconds()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        seconds = step(1)
    after = thread_cpu_seconds()
    if waiting:  # the shared-memory gather's own waits, inside FSDP's gather and copy-out
        waiting = {k: round(gather.waiting_s[k] - v, 3) for k, v in waiting.items()}
    used = {tid: after[tid] - before.get(tid, 0.0) for tid in after}
    main_cpu = used.pop(threading.get_native_id(), 0.0)
    # gloo's threads move the gathered bytes on the cores the ranks compute on; the profiler's and
    # torch's own threads count here too (a ddp step, with almost no collectives, shows their share)
    cpu = {"main thread": round(main_cpu, 3), "other threads": round(sum(used.values()), 3)}
    events = prof.key_averages()
    kinds = {kind: 0.0 for kind in KINDS}
    for e in events:
        kinds[kind_of(e.key)] += e.self_cpu_time_total / 1e6
    kinds["python (not in any operator)"] = max(0.0, seconds - sum(kinds.values()))
    by_op: dict[str, list[float]] = {}  # FSDP's events carry the module's name: one row per operator
    for e in events:
        row = by_op.setdefault(e.key.split(" (")[0], [0, 0.0])
        row[0] += e.count
        row[1] += e.self_cpu_time_total / 1e6
    top = sorted(by_op.items(), key=lambda kv: kv[1][1], reverse=True)[:20]
    rows = [{"op": op, "kind": kind_of(op), "calls": calls, "self_s": round(self_s, 3)} for op, (calls, self_s) in top]
    collectives = [e for e in events if e.key.startswith("c10d::") and not e.key.startswith("c10d::wait")]
    result = {"size": args.size, "dtype": str(cfg.model.dtype), "strategy": args.strategy, "fsdp_unit": args.fsdp_unit,
              "micro": args.micro_batch_size, "seq_len": args.seq_len, "malloc": malloc, "huge_pages": huge_pages,
              "shared_gather": shared,
              "warmup_step_s": round(warm, 3),
              "profiled_step_s": round(seconds, 3), "by_kind_s": {k: round(v, 3) for k, v in kinds.items()},
              "collective_calls": sum(e.count for e in collectives), "thread_cpu_s": cpu,
              "top_self": rows, "shared_gather_waits_s": waiting or None}
    if worker.is_main:
        print(f"{args.size} {args.strategy} ({args.fsdp_unit} units) {args.micro_batch_size} x {args.seq_len}: "
              f"step {seconds:.2f} s (warm-up {warm:.2f} s), {result['collective_calls']} collective calls")
        for kind, value in kinds.items():
            print(f"  {kind:<32} {value:8.3f} s  {value / seconds:6.1%}")
        print(f"CPU time in the step: main thread {cpu['main thread']:.2f} s, other threads (gloo) "
              f"{cpu['other threads']:.2f} s")
        if waiting:
            print(f"shared-memory gather waited {waiting['release']:.3f} s to take a buffer back, "
                  f"{waiting['write']:.3f} s for the other ranks' parts")
        print("operators with the most self time:")
        for r in rows:
            print(f"  {r['op'][:56]:<56} {r['kind'][:12]:<12} {r['calls']:6d} self {r['self_s']:7.3f} s")
        suffix = ("-glibc" * malloc.startswith("glibc defaults") + "-hugepages" * huge_pages
                  + "-gloo" * (args.strategy == "fsdp2" and not shared))
        out = HERE / "results" / (f"profile-{args.size}-{args.strategy}-{args.fsdp_unit}-{args.micro_batch_size}x"
                                  f"{args.seq_len}{suffix}.json")
        out.write_text(json.dumps({**result, **run_record()}, indent=2))
    distributed.teardown()
    distributed.exit_worker(0)


if __name__ == "__main__":
    main()
