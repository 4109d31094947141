"""GRPO with LoRA: shardtune against TRL's GRPOTrainer + peft, side by side in one run (issue 34's "Measure").

    nice -n 10 python bench/grpo_vs_trl.py            # 4 layers, 2 ranks, G 4, 8 completions a step, 4 steps
    nice -n 10 python bench/grpo_vs_trl.py --quick    # 2 layers, short prompts and completions: the pipeline

The model is bench/long_context.py's random Llama of SmolLM2-135M-Instruct's shape (hidden 576, MLP 1536, 9
heads, 3 key/value heads, the real 49,152-token vocabulary, tied embeddings) with ``--layers`` decoder layers
(default 4: the real width and vocabulary, shallower so that the run fits two shared cores), fp32, with the
tests' byte-level tokenizer. Every row: LoRA r16 (alpha 32) on all linear layers, G = ``--generations``
completions per prompt, ``--batch`` completions per optimizer step over both ranks (batch / G prompts), one
generation batch per step (num_iterations 1, β 0, TRL's default loss ``dapo``), temperature 1, the same prompts
of exactly ``--prompt-tokens`` tokens and the same reward function (``token_reward`` below, computed from the
completion's token ids, so it varies within each group and every step has a gradient).

Fixed completion lengths: TRL gets ``generation_kwargs={"min_new_tokens": N}`` (EOS suppressed until N
tokens); shardtune has no such knob, but the random model puts ~1/49,152 of its probability on EOS, so its
completions run to the limit too: each row reports ``completions/mean_length`` and the bench says so when a
completion ended early.

Rows (``--rows``):
  fsdp2      ``shardtune finetune --objective grpo --strategy fsdp2 --activation-checkpointing`` on 2 ranks
             (TRL's GRPOConfig turns gradient checkpointing on by default)
  fsdp2-nf4  the same with ``--quantize nf4`` (no TRL counterpart here: bitsandbytes has no CPU backend)
  fsdp2-glibc  the fsdp2 row with ``SHARDTUNE_MALLOC=default``: glibc's own allocator settings, as TRL's
             processes run, instead of the memory-first ones shardtune's CPU workers get
             (runtime/cpu_tuning.py: freed blocks of 128 KiB or more go back to the system, so they never
             count in the peak, and each new one is paged in again). What that choice costs in time and saves
             in memory, on CPU only (a GPU has its caching allocator); not planned (the planner counts the
             memory-first allocator)
  trl        TRL ``GRPOTrainer`` + peft ``LoraConfig`` under ``accelerate launch --num_processes 2`` (multi-CPU
             DDP, gloo, every rank holding the whole model), transformers' ``generate`` (no vLLM)

Per row: peak RssAnon+RssShmem of each rank, sampled from outside (the two largest processes of the job; the
same for every recipe); seconds per optimizer step (step 1 left out as warm-up), from shardtune's
metrics.jsonl and a TRL callback; generation time per step, timed around each tool's generation call on every
rank (TRL: ``GRPOTrainer._generate_single_turn`` wrapped in the worker; shardtune: the rollout's ``generate``
wrapped by an import hook this bench puts on the workers' path, so shardtune itself is unchanged), giving
generation tokens/s (completion tokens of the batch / the slowest rank's generation time) and training
tokens/s (prompt + completion tokens / the rest of the step); for shardtune rows ``shardtune plan --objective
grpo ... --json``'s predicted peak against the measured one. Ratios ours/TRL. Writes
bench/results/grpo-vs-trl.json (``--quick``: bench/.cache/grpo-vs-trl-quick.json).

``--repeat N`` runs the rows N times, interleaved (every row once, then every row again...), because two
runs of one recipe minutes apart on a shared 2-core machine differ by more than the differences measured.
A row is then its run of median seconds per step (its other figures from that same run; the peak, each
rank's largest of all runs), with every run's figures under ``runs``; the step-time verdict is the median of
the paired ratios (run i against TRL's run i, the two run next to each other), with each pair's ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
LORA = {"r": 16, "alpha": 32}
LR = 1e-5


def token_reward(prompts, completions, completion_ids, **kwargs) -> list[float]:
    """The reward both tools get (TRL's calling convention): a fixed function of the completion's token ids."""
    return [(sum(ids) % 97) / 97 for ids in completion_ids]


# ---- shardtune's generation time, without touching shardtune: an import hook on the workers' path -----------

HOOK = '''
import importlib.abc, importlib.machinery, json, os, sys, time

class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "shardtune.train.rollout":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            inner = module.generate

            def generate(*args, **kwargs):
                started = time.perf_counter()
                done = inner(*args, **kwargs)
                line = {"rank": int(os.environ.get("RANK", "0")), "seconds": time.perf_counter() - started,
                        "rows": len(done), "tokens": sum(len(c.ids) for c in done)}
                with open(os.environ["GRPO_BENCH_GEN_LOG"], "a") as f:
                    f.write(json.dumps(line) + "\\n")
                return done
            module.generate = generate
        spec.loader.exec_module = exec_module
        return spec

if os.environ.get("GRPO_BENCH_GEN_LOG"):
    sys.meta_path.insert(0, _Finder())
'''


def hook_dir(cache: Path) -> Path:
    path = cache / "grpo-bench-hook"
    path.mkdir(parents=True, exist_ok=True)
    (path / "sitecustomize.py").write_text(HOOK)
    return path


# ---- data -------------------------------------------------------------------------------------------------

def make_prompts(cache: Path, tokens: int, n: int) -> Path:
    """``n`` prompts of exactly ``tokens`` characters (the byte-level tokenizer: one token each, no specials)."""
    from dpo_speed import WORDS

    path = cache / f"grpo-prompts-{tokens}x{n}.jsonl"
    rng = random.Random(tokens)
    lines = []
    for i in range(n):
        words = [f"Q{i}:"]
        while len(" ".join(words)) < tokens:
            words.append(rng.choice(WORDS))
        lines.append(json.dumps({"prompt": " ".join(words)[:tokens]}))
    path.write_text("\n".join(lines) + "\n")
    return path


def check_prompts(model: Path, data: Path, tokens: int) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    for line in data.read_text().splitlines():
        n = len(tok(json.loads(line)["prompt"])["input_ids"])
        if n != tokens:
            raise SystemExit(f"{data}: a prompt is {n} tokens, not {tokens}")


# ---- the rows ---------------------------------------------------------------------------------------------

def timed_steps(seconds: list[float]) -> list[float]:
    return seconds[1:] if len(seconds) > 1 else seconds  # step 1: warm-up (allocator, first gloo calls)


def speeds(step_seconds: list[float], gen: list[dict], args: argparse.Namespace) -> dict:
    """Per step (after the first): seconds, generation seconds (slowest rank), generation and training tokens/s."""
    steps = timed_steps(step_seconds)
    gen_steps = timed_steps([max(g["seconds"]) for g in gen]) if gen else []
    out = {"step_seconds_mean": round(sum(steps) / len(steps), 3)}
    if len(gen_steps) == len(steps) and gen:
        tokens = timed_steps([sum(g["tokens"]) for g in gen])
        train_s = [s - g for s, g in zip(steps, gen_steps)]
        out.update(generation_seconds_mean=round(sum(gen_steps) / len(gen_steps), 3),
                   generation_tokens_per_second=round(sum(tokens) / sum(gen_steps), 2),
                   train_seconds_mean=round(sum(train_s) / len(train_s), 3),
                   train_tokens_per_second=round(args.batch * (args.prompt_tokens + args.completion_tokens)
                                                 * len(train_s) / sum(train_s), 2))
    return out


def per_step(lines: list[dict], nproc: int) -> list[dict]:
    """Generation records (one per rank per generation batch, in order) grouped by batch."""
    by_rank: dict[int, list[dict]] = {}
    for line in lines:
        by_rank.setdefault(line["rank"], []).append(line)
    n = min((len(v) for v in by_rank.values()), default=0)
    if len(by_rank) != nproc:
        return []
    return [{"seconds": [by_rank[r][i]["seconds"] for r in sorted(by_rank)],
             "tokens": [by_rank[r][i]["tokens"] for r in sorted(by_rank)]} for i in range(n)]


def shardtune_flags(model: Path, args: argparse.Namespace, extra: list[str]) -> list[str]:
    return ["--model", str(model), "--nproc", str(args.nproc), "--objective", "grpo", "--strategy", "fsdp2",
            "--reward", f"{Path(__file__).resolve()}:token_reward", "--num-generations", str(args.generations),
            "--max-completion-length", str(args.completion_tokens), "--batch-size", str(args.batch),
            "--micro-batch-size", str(args.batch // args.nproc), "--seq-len", str(args.prompt_tokens),
            "--lora-r", str(LORA["r"]), "--lora-alpha", str(LORA["alpha"]), "--lora-targets", "all-linear",
            "--dtype", "fp32", "--lr", str(LR), "--activation-checkpointing",
            *(["--memory-per-rank", args.memory_per_rank] if args.memory_per_rank else []), *extra]


def run_shardtune(name: str, extra: list[str], model: Path, data: Path, args: argparse.Namespace) -> dict:
    from dpo_speed import loadavg, run_sampled

    out = Path(tempfile.mkdtemp(prefix=f"grpo-{name}-", dir=args.cache))
    flags = shardtune_flags(model, args, extra)
    cmd = [sys.executable, "-m", "shardtune", "finetune", *flags, "--data", str(data), "--out", str(out / "run"),
           "--steps", str(args.steps), "--warmup-steps", "0", "--seed", "0"]
    gen_log = out / "generation.jsonl"
    env = ROW_ENV.get(name, {})
    os.environ.update(env, GRPO_BENCH_GEN_LOG=str(gen_log))
    os.environ["PYTHONPATH"] = os.pathsep.join([str(hook_dir(args.cache)), str(ROOT / "src"),
                                                os.environ.get("PYTHONPATH", "")])
    load = loadavg()
    try:
        rc, peaks, wall = run_sampled(cmd, out / "log.txt", args.timeout, args.nproc)
    finally:
        for key in [*env, "GRPO_BENCH_GEN_LOG"]:
            del os.environ[key]
    shown = [f"{k}={v}" for k, v in env.items()]
    row = {"name": name, "command": shlex.join([*shown, "shardtune", "finetune", *flags, "--steps", str(args.steps)]),
           **({"env": env, "about": ROW_ABOUT[name]} if env else {}),
           **({"memory_per_rank": args.memory_per_rank} if args.memory_per_rank else {}),
           "wall_seconds": wall, "log": str(out / "log.txt"), "loadavg_before": load}
    metrics = out / "run" / "metrics.jsonl"
    if rc or not metrics.exists():
        return {**row, "error": (out / "log.txt").read_text()[-2000:]}
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    summary = json.loads((out / "run" / "summary.json").read_text())
    gen = per_step([json.loads(x) for x in gen_log.read_text().splitlines()] if gen_log.exists() else [],
                   args.nproc)
    row.update(peak_mb=peaks, summary_peak_mb=summary.get("train_peak_mb"),
               generation_weights=generation_weights(summary.get("run_plan") or {}),
               step_seconds=[round(r["seconds"], 2) for r in records], generation=gen,
               completion_mean_length=[r.get("completions/mean_length") for r in records],
               reward=[r.get("reward") for r in records], loss=[r["loss"] for r in records],
               **speeds([r["seconds"] for r in records], gen, args))
    if not env:
        row["plan"] = plan(flags, row)
    return row


RUN_FIGURES = ("step_seconds_mean", "generation_seconds_mean", "train_seconds_mean", "peak_mb", "wall_seconds")


def merged(runs: list[dict]) -> dict:
    """One row from a recipe's repeated runs: the run of median seconds per step, each rank's peak the largest
    of all runs, every run's figures under ``runs``; a run that failed makes the row that failure."""
    if len(runs) == 1:
        return runs[0]
    failed = [r for r in runs if "error" in r]
    if failed:
        return failed[0]
    ordered = sorted(runs, key=lambda r: r["step_seconds_mean"])
    row = dict(ordered[(len(ordered) - 1) // 2])
    row["peak_mb"] = [max(ranks) for ranks in zip(*(r["peak_mb"] for r in runs))]
    row["runs"] = [{k: r[k] for k in RUN_FIGURES if k in r} for r in runs]
    if isinstance(row.get("plan", {}).get("peak_mb"), float):  # against the peak the row now shows
        row["plan"] = {**row["plan"], "error": round((row["plan"]["peak_mb"] - max(row["peak_mb"]))
                                                     / max(row["peak_mb"]), 4)}
    return row


def generation_weights(run_plan: dict) -> str:
    """How the run generated, from its run plan: the layers exchanged (computed from the row shards; in
    training too; every rank sampling all of its shard group's rows), kept gathered (into the training step
    too), or gathered per token; and whether 4-bit weights were dequantized once."""
    how = "exchanged, training too" if run_plan.get("layers_exchanged") else \
        "exchanged" if run_plan.get("generation_exchanged") else \
        "kept gathered" if run_plan.get("generation_gathered") else "gathered per token"
    how += " into training" if run_plan.get("generation_carried") else ""
    how += ", every rank all rows" if run_plan.get("generation_replicated") else ""
    return how + (", dequantized once" if run_plan.get("generation_dequantized") else "")


def plan(flags: list[str], row: dict) -> dict:
    """``shardtune plan --json`` with the run's flags: fsdp2's predicted peak against the measured one."""
    proc = subprocess.run([sys.executable, "-m", "shardtune", "plan", *flags, "--json"], capture_output=True,
                          text=True, cwd=ROOT)
    if proc.returncode:
        return {"error": proc.stderr[-1000:]}
    preds = json.loads(proc.stdout).get("fsdp2")
    pred = preds[0] if isinstance(preds, list) else preds
    if not isinstance(pred, dict) or "peak_mb" not in pred:
        return {"strategy": "fsdp2", "raw": preds}
    err = (pred["peak_mb"] - max(row["peak_mb"])) / max(row["peak_mb"])
    return {"strategy": "fsdp2", "peak_mb": round(pred["peak_mb"], 1), "error": round(err, 4)}


def run_trl(model: Path, data: Path, args: argparse.Namespace) -> dict:
    from dpo_speed import loadavg, run_sampled

    out = Path(tempfile.mkdtemp(prefix="grpo-trl-", dir=args.cache))
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(args.nproc), "--multi_gpu",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", str(Path(__file__).resolve()),
           "--trl-worker", "--model", str(model), "--data", str(data), "--work", str(out), "--steps",
           str(args.steps), "--batch", str(args.batch), "--nproc", str(args.nproc), "--generations",
           str(args.generations), "--completion-tokens", str(args.completion_tokens)]
    load = loadavg()
    rc, peaks, wall = run_sampled(cmd, out / "log.txt", args.timeout, args.nproc)
    row = {"name": "trl", "command": shlex.join(["accelerate", "launch", *cmd[3:]]), "wall_seconds": wall,
           "log": str(out / "log.txt"), "loadavg_before": load}
    results = sorted(out.glob("trl-rank*.json"))
    if rc or len(results) != args.nproc:
        return {**row, "error": (out / "log.txt").read_text()[-2000:]}
    ranks = [json.loads(p.read_text()) for p in results]
    gen = [{"seconds": [r["generation"][i]["seconds"] for r in ranks],
            "tokens": [r["generation"][i]["tokens"] for r in ranks]}
           for i in range(min(len(r["generation"]) for r in ranks))]
    main = ranks[0]
    return {**row, "peak_mb": peaks, "step_seconds": [round(s, 2) for s in main["seconds"]], "generation": gen,
            "completion_mean_length": main["mean_length"], "reward": main["reward"], "loss": main["loss"],
            **speeds(main["seconds"], gen, args)}


def trl_worker(args: argparse.Namespace) -> None:
    """One rank of the peer as TRL's docs show it: GRPOTrainer + a peft LoraConfig, the whole model per rank."""
    import torch
    from datasets import load_dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from dpo_speed import trainer_step_times

    torch.set_num_threads(1)  # 2 ranks on 2 cores: as shardtune's workers
    rank = int(os.environ.get("RANK", "0"))
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(args.model)
    step_times, seconds, logged = trainer_step_times()
    generation: list[dict] = []

    n = args.completion_tokens
    config = GRPOConfig(output_dir=str(Path(args.work) / "trl"), per_device_train_batch_size=args.batch // args.nproc,
                        gradient_accumulation_steps=1, num_generations=args.generations, max_completion_length=n,
                        generation_kwargs={"min_new_tokens": n}, max_steps=args.steps, learning_rate=LR,
                        lr_scheduler_type="constant", warmup_steps=0, logging_steps=1, save_strategy="no",
                        report_to="none", use_cpu=True, bf16=False, fp16=False, seed=0, dataloader_num_workers=0)
    lora = LoraConfig(r=LORA["r"], lora_alpha=LORA["alpha"], lora_dropout=0.0, target_modules="all-linear",
                      task_type="CAUSAL_LM")
    dataset = load_dataset("json", data_files=args.data, split="train")
    trainer = GRPOTrainer(model=model, reward_funcs=[token_reward], args=config, train_dataset=dataset,
                          processing_class=tok, peft_config=lora, callbacks=[step_times])
    inner = trainer._generate_single_turn

    def timed_generation(*a, **kw):
        started = time.perf_counter()
        done = inner(*a, **kw)
        generation.append({"seconds": time.perf_counter() - started, "tokens": sum(len(c) for c in done[0])})
        return done

    trainer._generate_single_turn = timed_generation
    trainer.train()
    (Path(args.work) / f"trl-rank{rank}.json").write_text(json.dumps({
        "seconds": seconds, "generation": generation, "loss": [line["loss"] for line in logged],
        "reward": [line.get("reward") for line in logged],
        "mean_length": [line.get("completions/mean_length") for line in logged]}))


# ---- report -----------------------------------------------------------------------------------------------

def label(row: dict) -> str:
    """A row's name, and the budget it was planned within when one was given."""
    return row["name"] + (f" (--memory-per-rank {row['memory_per_rank']})" if row.get("memory_per_rank") else "")


def table(rows: list[dict]) -> str:
    trl = next((r for r in rows if r["name"] == "trl" and "error" not in r), None)
    head = (f"{'row':<10} {'peak/rank MB':>13} {'s/step':>7} {'gen s':>6} {'gen tok/s':>9} {'train tok/s':>11} "
            f"{'peak/TRL':>8} {'step/TRL':>8} {'gen/TRL':>7} {'planner MB':>10} {'err':>7}")
    lines = [head]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['name']:<10} FAILED: {r['error'].strip().splitlines()[-1][:90]}")
            continue
        peak = max(r["peak_mb"])

        def ratio(key: str, row: dict = r) -> str:
            return f"{row[key] / trl[key]:.2f}" if trl and row.get(key) and trl.get(key) else "-"
        pr = f"{peak / max(trl['peak_mb']):.2f}" if trl else "-"
        p = r.get("plan", {})
        pm = f"{p['peak_mb']:.0f}" if "peak_mb" in p else "-"
        pe = f"{p['error']:+.1%}" if isinstance(p.get("error"), float) else "-"
        gs = r.get("generation_seconds_mean")
        spread = [x["step_seconds_mean"] for x in r.get("runs", [])]
        shown = f" ({min(spread):.2f}-{max(spread):.2f})" if spread else ""
        lines.append(f"{label(r) + shown:<10} {peak:>13.0f} {r['step_seconds_mean']:>7.2f} {gs if gs else '-':>6} "
                     f"{r.get('generation_tokens_per_second', '-'):>9} {r.get('train_tokens_per_second', '-'):>11} "
                     f"{pr:>8} {ratio('step_seconds_mean'):>8} {ratio('generation_tokens_per_second'):>7} "
                     f"{pm:>10} {pe:>7}")
    return "\n".join(lines)


def row_key(row: dict) -> tuple[str, str | None]:
    """A row is its recipe and the budget it was planned within (``--add`` replaces a row with the same)."""
    return row["name"], row.get("memory_per_rank")


def verdicts(rows: list[dict], args: argparse.Namespace) -> list[str]:
    # every row on its own, a budget row named by its budget (the targets: peak <= 0.6x TRL's,
    # 0.35x with nf4; time per step <= 1.0x)
    trl = next((r for r in rows if r["name"] == "trl" and "error" not in r), None)
    lines: list[str] = []

    def check(what: str, value: float, target: float) -> None:
        lines.append(f"{what}: {value:.2f} <= {target}: {'met' if value <= target else 'NOT met'}")

    for r in (r for r in rows if trl and r["name"] != "trl" and "error" not in r):
        within = f" within --memory-per-rank {r['memory_per_rank']}" if r.get("memory_per_rank") else ""
        what = f"{r['name']}{within}" + (" (glibc's allocator settings, SHARDTUNE_MALLOC=default)"
                                         if r["name"] == "fsdp2-glibc" else "")
        nf4 = r["name"] == "fsdp2-nf4"
        check(f"peak {what} / TRL" + (" (unquantized: no 4-bit TRL on CPU)" if nf4 else ""),
              max(r["peak_mb"]) / max(trl["peak_mb"]), 0.35 if nf4 else 0.6)
        pairs = [a["step_seconds_mean"] / b["step_seconds_mean"]
                 for a, b in zip(r.get("runs", []), trl.get("runs", []))]
        if len(pairs) > 1:  # run i against TRL's run i, the two next to each other in time
            check(f"s/step {what} / TRL, the median of {len(pairs)} paired runs "
                  f"({', '.join(f'{x:.2f}' for x in pairs)})", sorted(pairs)[(len(pairs) - 1) // 2], 1.0)
        else:
            check(f"s/step {what} / TRL", r["step_seconds_mean"] / trl["step_seconds_mean"], 1.0)
    for r in (r for r in rows if "error" not in r):
        p = r.get("plan", {})
        if isinstance(p.get("error"), float):
            ok = abs(p["error"]) <= 0.10
            lines.append(f"planner {r['name']}: {p['peak_mb']:.0f} vs measured {max(r['peak_mb']):.0f} "
                         f"({p['error']:+.1%}) within 10%: {'met' if ok else 'NOT met'}")
        short = [x for x in r.get("completion_mean_length", []) if x is not None and x < args.completion_tokens]
        if short:
            lines.append(f"{r['name']}: a completion ended before {args.completion_tokens} tokens "
                         f"(mean lengths {r['completion_mean_length']})")
    return lines


ROWS: dict[str, list[str]] = {"fsdp2": [], "fsdp2-nf4": ["--quantize", "nf4"], "fsdp2-glibc": []}
#: a row's environment beside its flags
ROW_ENV: dict[str, dict[str, str]] = {"fsdp2-glibc": {"SHARDTUNE_MALLOC": "default"}}
#: what a row with an environment is, in the words the generated docs show
ROW_ABOUT: dict[str, str] = {
    "fsdp2-glibc": "the fsdp2 row with glibc's own allocator settings, as TRL's processes run, not the memory-first "
                   "ones shardtune's CPU workers get (CPU only)"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    names = [*ROWS, "trl"]
    parser.add_argument("--rows", default=",".join(names), help="comma-separated: " + ", ".join(names))
    parser.add_argument("--layers", type=int, default=4, help="decoder layers of the SmolLM2-135M-shaped model")
    parser.add_argument("--size", choices=["smollm2", "1.1b"], default="smollm2",
                        help="the model: SmolLM2-135M's shape with --layers layers, or bench/fake_model.py's random "
                             "TinyLlama-1.1B shape (22 layers, untied 32k vocabulary, bf16 on disk, run in fp32), "
                             "where the weights, not the processes' runtime, make most of each peak")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps (the first is warm-up)")
    parser.add_argument("--batch", type=int, default=8, help="completions per optimizer step over all ranks")
    parser.add_argument("--generations", type=int, default=4, help="completions per prompt (G)")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--completion-tokens", type=int, default=32)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--timeout", type=int, default=900, help="seconds per row")
    parser.add_argument("--repeat", type=int, default=1,
                        help="run the rows this many times, interleaved: a row is its median run (module doc)")
    parser.add_argument("--quick", action="store_true", help="2 layers, 16 + 8 tokens, 2 steps: the pipeline")
    parser.add_argument("--cache", type=Path, default=HERE / ".cache")
    parser.add_argument("--out", type=Path, default=None, help="default: bench/results/grpo-vs-trl.json")
    parser.add_argument("--memory-per-rank", default=None,
                        help="shardtune rows: the planner's budget (e.g. 2GiB; default: the machine's RAM per rank). "
                             "Within a tight one it keeps 4-bit weights 4-bit while generating, at the cost of speed")
    parser.add_argument("--add", action="store_true",
                        help="merge the rows run into the result file: a row of the same name is replaced")
    parser.add_argument("--replan", action="store_true",
                        help="run no job: predict the result file's rows again with the planner as it is now")
    parser.add_argument("--trl-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    args = parser.parse_args()
    sys.path[:0] = [str(HERE), str(ROOT / "src"), str(ROOT / "tests")]
    if args.trl_worker:
        trl_worker(args)
        return
    if args.quick:
        args.layers, args.prompt_tokens, args.completion_tokens, args.steps = 2, 16, 8, 2
    if args.batch % (args.generations * 1) or args.batch % args.nproc:
        parser.error("--batch must be a multiple of --generations and of --nproc")
    from long_context import make_model
    from record import git_commit, plan_flags, replan_record, run_record

    args.cache.mkdir(parents=True, exist_ok=True)
    if args.size == "1.1b":
        from fake_model import make_checkpoint

        model, described = make_checkpoint("1.1b", args.cache), "TinyLlama-1.1B shape (22 layers), random"
    else:
        model, described = make_model(args.layers, args.cache), f"SmolLM2-135M shape, {args.layers} layers, random"
    data = make_prompts(args.cache, args.prompt_tokens, args.batch // args.generations * args.steps * 2)
    check_prompts(model, data, args.prompt_tokens)
    named = "grpo-vs-trl-1.1b.json" if args.size == "1.1b" else "grpo-vs-trl.json"
    out = args.out or (args.cache / "grpo-vs-trl-quick.json" if args.quick else HERE / "results" / named)
    if args.replan:  # no job: the measured rows predicted again by the planner as it is now
        if not out.is_file():
            parser.error(f"--replan predicts the measured rows of {out} again: no such file")
        result = json.loads(out.read_text())
        for row in result["rows"]:
            if "plan" in row:
                row["plan"] = {**plan(plan_flags(row["command"], model), row), "commit": git_commit()}
        result["replanned"] = replan_record()
        result["targets"] = verdicts(result["rows"], args)
        result["table"] = table(result["rows"]) + "\n\n" + "\n".join(result["targets"])
        print(result["table"])
        out.write_text(json.dumps(result, indent=1))
        print(f"wrote {out}")
        return
    runs: dict[str, list[dict]] = {name: [] for name in args.rows.split(",")}
    for i in range(args.repeat):  # interleaved: the runs of every row spread over the same minutes
        for name, done in runs.items():
            print(f"running {name}{f' ({i + 1} of {args.repeat})' if args.repeat > 1 else ''} ...", flush=True)
            row = run_trl(model, data, args) if name == "trl" else run_shardtune(name, ROWS[name], model, data, args)
            done.append(row)
            print(json.dumps({k: v for k, v in row.items() if k not in ("command", "generation")})[:800], flush=True)
    rows = [{**merged(done), "commit": git_commit()} for done in runs.values()]
    if args.add and out.is_file():  # the file's other rows kept, in their order; a row run again replaced
        new = {row_key(r): r for r in rows}
        earlier = json.loads(out.read_text())
        # each kept row says the commit it ran at (rows from before rows said it: the file's then)
        kept = [{**r, "commit": r.get("commit", earlier.get("commit"))} for r in earlier["rows"]]
        rows = [new.pop(row_key(r), r) for r in kept] + list(new.values())
    text, lines = table(rows), verdicts(rows, args)
    print(text + "\n\n" + "\n".join(lines))
    from dpo_speed import loadavg

    layers = 22 if args.size == "1.1b" else args.layers
    result = {**run_record(), "model": described, "size": args.size, "layers": layers,
              "dtype": "fp32", "nproc": args.nproc, "steps": args.steps, "repeat": args.repeat,
              "global_batch": args.batch,
              "generations": args.generations, "prompt_tokens": args.prompt_tokens,
              "completion_tokens": args.completion_tokens, "lora": LORA, "loadavg_end": loadavg(), "rows": rows,
              "table": text + "\n\n" + "\n".join(lines), "targets": lines}
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
