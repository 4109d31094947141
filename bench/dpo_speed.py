"""DPO speed and per-rank peak memory: shardtune against TRL's DPOTrainer + peft, side by side in one run.

    nice -n 19 .venv/bin/python bench/dpo_speed.py --size 1.1b      # 2 ranks, 4 pairs a step, 3 steps
    .venv/bin/python bench/dpo_speed.py --size tiny --steps 2        # a quick check of the whole pipeline

Rows: shardtune DPO --strategy fsdp2 with activation checkpointing (TRL's default); + --quantize nf4; fsdp2
without it, alone and + --precompute-reference; --strategy auto; and the peer as its users run it: TRL
DPOTrainer + peft LoraConfig under `accelerate launch --num_processes 2` (plain multi-CPU DDP, every rank
holding the whole model). Every row is its own fresh job. Peak memory is
sampled from outside (RssAnon+RssShmem of every process of the job; the two largest are the ranks), so
every recipe is measured the same way. Pairs per second count training steps only (step 1 left out as
warm-up when there are more than one), from shardtune's metrics.jsonl and a TRL callback's step times.
Writes bench/results/dpo-<size>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
WORDS = "the a river stone quiet market bright winter paper garden slow green road north city light".split()


def bf16_fast() -> bool:
    import torch

    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def make_pairs(path: Path, n: int, side_chars: int, seed: int = 0) -> Path:
    """Pairs with a short prompt and ~side_chars characters (the byte-level tokenizer: ~1 token each) a side."""
    rng = random.Random(seed)

    def text(chars: int) -> str:
        words = []
        while sum(len(w) + 1 for w in words) < chars:
            words.append(rng.choice(WORDS))
        return " ".join(words)[:chars]

    with path.open("w") as f:
        for i in range(n):
            f.write(json.dumps({"prompt": f"Question {i}: {text(12)}?\n", "chosen": text(side_chars),
                                "rejected": text(side_chars)}) + "\n")
    return path


class TreeSampler:
    """Peak RssAnon+RssShmem of every process under one pid, sampled from /proc (no help from the job)."""

    def __init__(self, root_pid: int, every: float = 0.1) -> None:
        self.root, self.every, self.peak_kb = root_pid, every, {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _children(self) -> list[int]:
        parents: dict[int, int] = {}
        for d in os.listdir("/proc"):
            if d.isdigit():
                try:
                    with open(f"/proc/{d}/stat") as f:
                        parents[int(d)] = int(f.read().rsplit(")", 1)[1].split()[1])
                except OSError:
                    pass
        tree, todo = [], [self.root]
        while todo:
            pid = todo.pop()
            tree.append(pid)
            todo += [c for c, p in parents.items() if p == pid]
        return tree

    @staticmethod
    def _rss_kb(pid: int) -> int:
        kb = 0
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith(("RssAnon:", "RssShmem:")):
                        kb += int(line.split()[1])
        except OSError:
            pass
        return kb

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            for pid in self._children():
                self.peak_kb[pid] = max(self.peak_kb.get(pid, 0), self._rss_kb(pid))

    def ranks_mb(self, n: int) -> list[float]:
        self._stop.set()
        self._thread.join()
        # the launcher (the root) holds no model: the n largest of the rest are the ranks
        workers = [kb for pid, kb in self.peak_kb.items() if pid != self.root]
        return [round(kb / 1024, 1) for kb in sorted(workers, reverse=True)[:n]]


def loadavg() -> list[str]:
    """The 1/5/15-minute load averages: a row timed on a busy machine shows it."""
    return Path("/proc/loadavg").read_text().split()[:3]


def run_sampled(cmd: list[str], log: Path, timeout: int, nproc: int) -> tuple[int, list[float], float]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    started = time.perf_counter()
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        sampler = TreeSampler(proc.pid)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
    return rc, sampler.ranks_mb(nproc), round(time.perf_counter() - started, 1)


def shardtune_flags(args: argparse.Namespace, model: Path, extra: list[str]) -> list[str]:
    return ["--model", str(model), "--nproc", str(args.nproc), "--objective", "dpo", "--batch-size",
            str(args.batch), "--micro-batch-size", str(args.batch // args.nproc), "--seq-len", str(args.seq_len),
            "--lora-r", "8", "--lora-alpha", "16", "--lora-targets", "q_proj,v_proj", "--dtype", args.dtype, *extra]


def step_speed(seconds: list[float], batch: int) -> float:
    timed = seconds[1:] if len(seconds) > 1 else seconds  # step 1: warm-up (allocator, first gloo calls)
    return batch * len(timed) / sum(timed)


def run_shardtune(name: str, extra: list[str], model: Path, data: Path, args: argparse.Namespace) -> dict:
    out = Path(tempfile.mkdtemp(prefix=f"dpo-{name}-"))
    flags = shardtune_flags(args, model, extra)
    cmd = [sys.executable, "-m", "shardtune", "finetune", *flags, "--data", str(data), "--out", str(out / "run"),
           "--steps", str(args.steps), "--warmup-steps", "0"]
    load = loadavg()
    rc, peaks, wall = run_sampled(cmd, out / "log.txt", args.timeout, args.nproc)
    row = {"name": name, "command": " ".join(cmd), "wall_seconds": wall, "log": str(out / "log.txt"),
           "loadavg_before": load}
    metrics = out / "run" / "metrics.jsonl"
    if rc or not metrics.exists():
        return {**row, "error": (out / "log.txt").read_text()[-2000:]}
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    summary = json.loads((out / "run" / "summary.json").read_text())
    row.update(peak_mb=peaks, step_seconds=[round(r["seconds"], 2) for r in records],
               pairs_per_second=round(step_speed([r["seconds"] for r in records], args.batch), 4),
               loss_first=records[0]["loss"], summary_peak_mb=summary.get("train_peak_mb"),
               chosen=summary.get("strategy") or summary.get("chosen"))
    row["plan"] = plan(flags, row, args)
    return row


def plan(flags: list[str], row: dict, args: argparse.Namespace) -> dict:
    """`shardtune plan --json` with the run's flags: the prediction for the strategy the run used."""
    proc = subprocess.run([sys.executable, "-m", "shardtune", "plan", *flags, "--json"], capture_output=True,
                          text=True, cwd=ROOT)
    if proc.returncode:
        return {"error": proc.stderr[-1000:]}
    plans = json.loads(proc.stdout)
    strategy = flags[flags.index("--strategy") + 1]
    if strategy == "auto":
        strategy = _picked(row) or strategy
    preds = plans.get(strategy)
    pred = preds[0] if isinstance(preds, list) else preds
    if not isinstance(pred, dict) or "peak_mb" not in pred:
        return {"strategy": strategy, "raw": plans}
    err = (pred["peak_mb"] - max(row["peak_mb"])) / max(row["peak_mb"])
    return {"strategy": strategy, "peak_mb": round(pred["peak_mb"], 1), "error": round(err, 4)}


def _picked(row: dict) -> str | None:
    """The strategy --strategy auto chose, from the run's log line."""
    text = Path(row["log"]).read_text()
    for s in ("fsdp2", "fsdp1", "ddp", "single"):
        if f"strategy {s}" in text or f"strategy: {s}" in text or f"-> {s}" in text:
            return s
    return row.get("chosen")


def run_trl(model: Path, data: Path, args: argparse.Namespace) -> dict:
    out = Path(tempfile.mkdtemp(prefix="dpo-trl-"))
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(args.nproc), "--multi_gpu",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", str(Path(__file__).resolve()),
           "--trl-worker", "--model", str(model), "--data", str(data), "--out", str(out), "--steps", str(args.steps),
           "--batch", str(args.batch), "--nproc", str(args.nproc), "--seq-len", str(args.seq_len),
           "--dtype", args.dtype]
    load = loadavg()
    rc, peaks, wall = run_sampled(cmd, out / "log.txt", args.timeout, args.nproc)
    row = {"name": "trl-dpo-ddp", "command": " ".join(cmd), "wall_seconds": wall, "log": str(out / "log.txt"),
           "loadavg_before": load}
    result = out / "trl.json"
    if rc or not result.exists():
        return {**row, "error": (out / "log.txt").read_text()[-2000:]}
    steps = json.loads(result.read_text())
    return {**row, "peak_mb": peaks, "step_seconds": [round(s, 2) for s in steps["seconds"]],
            "pairs_per_second": round(step_speed(steps["seconds"], args.batch), 4), "loss_first": steps["loss_first"]}


def trainer_step_times() -> tuple[Any, list[float], list[dict]]:
    """A transformers ``TrainerCallback`` for a peer's trainer, with the lists it fills: each optimizer step's
    seconds, and each logged line that has a loss (TRL's metrics of that step)."""
    from transformers import TrainerCallback

    seconds: list[float] = []
    logged: list[dict] = []

    class StepTimes(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            self.t = time.perf_counter()

        def on_step_end(self, a, state, control, **kw):
            seconds.append(time.perf_counter() - self.t)

        def on_log(self, a, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                logged.append(dict(logs))

    return StepTimes(), seconds, logged


def trl_worker(args: argparse.Namespace) -> None:
    """One rank of the peer, as TRL's docs show it: DPOTrainer + a peft LoraConfig, the whole model per rank."""
    import torch
    from datasets import load_dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    torch.set_num_threads(1)  # 2 ranks on 2 cores: as shardtune's workers
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
    tok = AutoTokenizer.from_pretrained(args.model)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    step_times, seconds, logged = trainer_step_times()

    config = DPOConfig(output_dir=str(Path(args.out) / "trl"), per_device_train_batch_size=args.batch // args.nproc,
                       gradient_accumulation_steps=1, max_steps=args.steps, max_length=args.seq_len,
                       learning_rate=2e-4, lr_scheduler_type="constant", warmup_steps=0, logging_steps=1,
                       save_strategy="no", report_to="none", use_cpu=True, bf16=args.dtype == "bf16",
                       dataloader_num_workers=0, remove_unused_columns=False)
    lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    dataset = load_dataset("json", data_files=args.data, split="train")
    trainer = DPOTrainer(model=model, args=config, train_dataset=dataset, processing_class=tok, peft_config=lora,
                         callbacks=[step_times])
    trainer.train()
    if int(os.environ.get("RANK", "0")) == 0:
        (Path(args.out) / "trl.json").write_text(json.dumps({"seconds": seconds,
                                                             "loss_first": logged[0]["loss"] if logged else None}))


def machine(args: argparse.Namespace) -> dict:
    import torch

    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((ln.split(":", 1)[1].strip() for ln in lscpu.splitlines() if ln.startswith("Model name")), "")
    versions = {}
    for mod in ("transformers", "peft", "trl", "accelerate"):
        versions[mod] = __import__(mod).__version__
    return {"cpu": model, "cores": os.cpu_count(), "torch": torch.__version__, **versions,
            "mkldnn_bf16": bf16_fast(), "python": platform.python_version(), "command": " ".join(sys.argv),
            "loadavg_start": loadavg()}


def ratio_lines(rows: list[dict]) -> list[str]:
    by = {r["name"]: r for r in rows if "error" not in r}
    trl = by.get("trl-dpo-ddp")
    lines = []

    def check(what: str, value: float, op: str, target: float) -> None:
        ok = value <= target if op == "<=" else value >= target
        lines.append(f"{what}: {value:.2f} {op} {target}: {'met' if ok else 'NOT met'}")

    if trl:
        # the targets: memory of the fsdp2 rows (set as TRL runs), speed of the best shardtune row
        # (auto may pick any strategy); the other rows' ratios are in the table
        if "fsdp2" in by:
            check("peak fsdp2 / TRL (unquantized)", max(by["fsdp2"]["peak_mb"]) / max(trl["peak_mb"]), "<=", 0.6)
        if "fsdp2-nf4" in by:
            check("peak fsdp2-nf4 / TRL", max(by["fsdp2-nf4"]["peak_mb"]) / max(trl["peak_mb"]), "<=", 0.35)
        if "auto" in by:
            check("pairs/s auto / TRL", by["auto"]["pairs_per_second"] / trl["pairs_per_second"], ">=", 1.0)
    if "fsdp2-noac" in by and "fsdp2-precompute" in by:
        check("step speed precompute / plain", by["fsdp2-precompute"]["pairs_per_second"]
              / by["fsdp2-noac"]["pairs_per_second"], ">=", 1.3)
    for r in rows:
        p = r.get("plan", {})
        if "error" in r or not isinstance(p.get("error"), float):
            continue
        ok = abs(p["error"]) <= 0.10
        lines.append(f"planner {r['name']} ({p['strategy']}): {p['peak_mb']:.0f} vs measured {max(r['peak_mb']):.0f} "
                     f"({p['error']:+.1%}) within 10%: {'met' if ok else 'NOT met'}")
    return lines


def table(rows: list[dict]) -> str:
    trl = next((r for r in rows if r["name"] == "trl-dpo-ddp" and "error" not in r), None)
    head = (f"{'row':<18} {'peak/rank MB':>14} {'pairs/s':>9} {'peak/TRL':>9} {'speed/TRL':>10} "
            f"{'planner MB':>11} {'err':>7}")
    lines = [head]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['name']:<18} FAILED: {r['error'].strip().splitlines()[-1][:90]}")
            continue
        peak, speed = max(r["peak_mb"]), r["pairs_per_second"]
        pr = f"{peak / max(trl['peak_mb']):.2f}" if trl else "-"
        sr = f"{speed / trl['pairs_per_second']:.2f}" if trl else "-"
        p = r.get("plan", {})
        pm = f"{p['peak_mb']:.0f}" if "peak_mb" in p else "-"
        pe = f"{p['error']:+.1%}" if isinstance(p.get("error"), float) else "-"
        name = r["name"] + (f" ({p['strategy']})" if r["name"] == "auto" and p.get("strategy") else "")
        lines.append(f"{name:<18} {peak:>14.0f} {speed:>9.3f} {pr:>9} {sr:>10} {pm:>11} {pe:>7}")
    return "\n".join(lines)


# TRL's DPOConfig turns gradient checkpointing on by default, so the rows compared with it for memory
# recompute activations too; precompute is judged against the same setting without it (what auto picks
# when everything fits), where the reference forward it saves is the larger share of a step.
ROWS: dict[str, list[str]] = {
    "fsdp2": ["--strategy", "fsdp2", "--activation-checkpointing"],
    "fsdp2-nf4": ["--strategy", "fsdp2", "--quantize", "nf4", "--activation-checkpointing"],
    "fsdp2-noac": ["--strategy", "fsdp2"],
    "fsdp2-precompute": ["--strategy", "fsdp2", "--precompute-reference"],
    "auto": ["--strategy", "auto"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="1.1b", help="a size of bench/fake_model.py (tiny, 80m, 150m, 1.1b, 7b)")
    parser.add_argument("--cache", type=Path, default=HERE / ".cache")
    names = [*ROWS, "trl"]
    parser.add_argument("--rows", default=",".join(names), help="comma-separated: " + ", ".join(names))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4, help="global batch in pairs")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--side-chars", type=int, default=256, help="characters (~tokens) per chosen/rejected")
    parser.add_argument("--seq-len", type=int, default=320, help="prompt + one response, in tokens")
    parser.add_argument("--dtype", default="", help="default: bf16 where oneDNN computes it fast, else fp32")
    parser.add_argument("--timeout", type=int, default=1800)
    parser.add_argument("--out", type=Path, default=None, help="default: bench/results/dpo-<size>.json")
    parser.add_argument("--trl-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trl_worker:
        trl_worker(args)
        return
    from fake_model import make_checkpoint

    args.dtype = args.dtype or ("bf16" if bf16_fast() else "fp32")
    model = make_checkpoint(args.size, args.cache)
    data = make_pairs(args.cache / f"pairs-{args.side_chars}.jsonl", n=args.batch * args.steps * 2,
                      side_chars=args.side_chars)
    rows = []
    for name in args.rows.split(","):
        print(f"running {name} ...", flush=True)
        row = run_trl(model, data, args) if name == "trl" else run_shardtune(name, ROWS[name], model, data, args)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("command",)})[:600], flush=True)
    text = table(rows)
    lines = ratio_lines(rows)
    print(text)
    print("\n".join(lines))
    result = {"size": args.size, "steps": args.steps, "global_batch_pairs": args.batch, "nproc": args.nproc,
              "side_tokens": args.side_chars, "seq_len": args.seq_len, "dtype": args.dtype, "machine": machine(args),
              "rows": rows, "table": text.splitlines(), "targets": lines}
    out = args.out or HERE / "results" / f"dpo-{args.size}.json"
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
