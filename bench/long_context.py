"""Long context: peak memory and tokens/s against the sequence length, shardtune against TRL and plain HF.

    nice -n 10 python bench/long_context.py                     # 4 layers: 2k, 4k, 8k, 16k tokens, every row
    python bench/long_context.py --layers 30 --rows shardtune,trl --lengths 4096,8192
    python bench/long_context.py --quick                        # tiny lengths: the whole pipeline in minutes

The model is a random Llama with SmolLM2-135M-Instruct's shape (hidden 576, MLP 1536, 9 heads, 3
key/value heads, 49,152-token vocabulary, tied embeddings, rope theta 1e5) and ``--layers`` decoder
layers (4: issue 32's table; 30: the real depth), stored in fp32 with a byte-level tokenizer: each
record is ``tokens - 1`` characters of plain words and every recipe ends it with EOS, so a record is
exactly ``tokens`` tokens. Every recipe: LoRA r16 (alpha 32) on all linear layers, fp32, batch 1, the
same records; each row is a fresh job whose processes' RssAnon+RssShmem are sampled from outside.

Rows (``--rows``):
  shardtune  ``shardtune finetune --activation-checkpointing``, 1 process, one record per step, per length
  trl        TRL ``SFTTrainer`` + peft ``LoraConfig`` (gradient checkpointing on, its default loss), 1 process
  hf         transformers + peft, ``gradient_checkpointing_enable``, a hand loop ``model(...).loss.backward()``
  fsdp2      shardtune ``--strategy fsdp2`` on 2 ranks, batch 2: each rank holds one record of the length
  packed     shardtune ``--packing``: ``--pack-records`` records in one row of the length, against the
             shardtune row of that length (same tokens, one record)
  ref        the shardtune row at ``--speed-tokens`` run from ``--compare-ref`` (default: 9975824, the commit
             before the loss head), from a ``git archive`` of its src/: tokens/s then and now
  verify     shardtune with ``--memory-per-rank`` the budget at the longest length its line (or ``plan
             --seq-len max``) says fits ``--budget-gib``, when that is at most ``--verify-max`` tokens
Per row: each process's sampled peak, shardtune's summary train_peak_mb, tokens/s (step 1 left out as warm-up
when there are more steps) and ``shardtune plan --json``'s prediction. Derived (bench/long_context_figures.py):
peak per extra token between the two longest lengths, as a multiple of the floor (each layer's checkpointed
input + one layer's recomputed set, from shardtune's fake-tensor pass), the longest context within the budget
and its ratio to TRL's, tokens/s against the reference, packed against unpacked; each target a verdict line.

``--replan`` runs no job: it asks the planner as it is now for each measured shardtune row's prediction
(recorded with the planner's commit beside the measurement's), then derives the figures again.

Results merge into bench/results/long-context-<layers>l.json (a row replaces the one of the same recipe and
length; ``--fresh`` starts over), so the rows can run in pieces; ``--quick`` writes under bench/.cache/.
Extra shardtune flags for every shardtune row but ref (e.g. ``--shardtune-flags="--mlp-tile auto"``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(HERE), str(ROOT / "src"), str(ROOT / "tests")]
from dpo_speed import WORDS, TreeSampler, loadavg, trainer_step_times  # noqa: E402
from long_context_figures import RECIPES as ROWS  # noqa: E402
from long_context_figures import derive, figure_lines, order, table, verdicts  # noqa: E402
from record import git_commit, plan_flags, replan_record, run_record  # noqa: E402

SMOLLM2 = dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
               vocab_size=49152, tie_word_embeddings=True, rms_norm_eps=1e-5, rope_theta=100000.0,
               hidden_act="silu", initializer_range=0.02)
MAX_POSITIONS = 131072  # far beyond the longest row: no warning about extending the context
LORA = {"r": 16, "alpha": 32}
DEFAULT_REF = "9975824"


# ---- the model and the records --------------------------------------------------------------------

def make_model(layers: int, cache: Path) -> Path:
    """The random SmolLM2-135M-shaped model with ``layers`` layers, in fp32, made once under ``cache``."""
    path = cache / f"smollm2-135m-shape-{layers}l"
    if (path / "model.safetensors").is_file():
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tiny import make_tokenizer

    torch.manual_seed(0)
    # the tokenizer's ids: bytes 0-255, then <s>, </s>, <pad>
    config = LlamaConfig(**SMOLLM2, num_hidden_layers=layers, max_position_embeddings=MAX_POSITIONS,
                         bos_token_id=256, eos_token_id=257, pad_token_id=258)
    tmp = path.with_name(path.name + ".tmp")
    LlamaForCausalLM(config).save_pretrained(tmp)  # transformers' init: normal(0, 0.02), fp32
    make_tokenizer().save_pretrained(tmp)
    tmp.rename(path)
    return path


def make_records(cache: Path, tokens: int, n: int) -> Path:
    """``n`` records of ``tokens`` tokens each: ``tokens - 1`` characters of plain words (one byte-level
    token each) and the EOS every recipe appends to a text record."""
    path = cache / f"records-{tokens}x{n}.jsonl"
    if path.is_file():
        return path
    rng = random.Random(tokens)
    lines = []
    for _ in range(n):
        words: list[str] = []
        while sum(len(w) + 1 for w in words) < tokens:
            words.append(rng.choice(WORDS))
        lines.append(json.dumps({"text": " ".join(words)[: tokens - 1]}))
    path.write_text("\n".join(lines) + "\n")
    return path


def check_records(model: Path, data: Path, tokens: int) -> None:
    """Every record is exactly ``tokens`` tokens with EOS (the rows compare equal work)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    for line in data.read_text().splitlines():
        n = len(tok(json.loads(line)["text"])["input_ids"]) + 1
        if n != tokens:
            raise SystemExit(f"{data}: a record is {n} tokens, not {tokens}")


def floor(model: Path, lengths: tuple[int, int]) -> dict:
    """Issue 32's floor per token: each layer's checkpointed input (hidden × bytes) plus one layer's
    recomputed set, what autograd saves for one layer without checkpointing. The set comes from
    shardtune's fake-tensor pass (model/footprint.py: the real kernels' shapes, no memory) over the model
    with LoRA and the attention the run uses (train/attention.py, no mask), per token between two lengths."""
    import torch

    from shardtune.config import build_config
    from shardtune.model.attention import use_shardtune_attention
    from shardtune.model.footprint import _saved_bytes, model_dir_for_plan
    from shardtune.model.lora import inject_lora
    from shardtune.model.meta import build_meta_model

    cfg = build_config({"model": str(model), "dtype": "fp32", "lora-r": LORA["r"], "lora-alpha": LORA["alpha"],
                        "lora-targets": "all-linear"})
    meta, _ = inject_lora(build_meta_model(model_dir_for_plan(model), torch.float32), cfg.lora, 0)
    attention = use_shardtune_attention(meta)
    saved = [max(_saved_bytes(meta, 1, n, torch.float32, torch.device("cpu")).per_layer) for n in lengths]
    layer = (saved[1] - saved[0]) / (lengths[1] - lengths[0])
    base = meta.get_base_model().config
    layers, hidden = base.num_hidden_layers, base.hidden_size
    inputs = layers * hidden * 4
    return {"bytes_per_token": inputs + layer, "checkpointed_inputs_bytes_per_token": inputs,
            "one_layer_saved_bytes_per_token": layer, "lengths": list(lengths), "attention": attention,
            "how": f"{layers} layers x {hidden} hidden x 4 B (each layer's checkpointed input) + {layer:.0f} B (what "
                   f"one layer saves for backward without checkpointing, LoRA r{LORA['r']} all-linear, {attention} "
                   f"attention: a fake-tensor pass as shardtune's planner runs it, model/footprint.py, per token "
                   f"between {lengths[0]} and {lengths[1]} tokens)"}


# ---- one job ---------------------------------------------------------------------------------------

def run_job(cmd: list[str], log: Path, timeout: int, nproc: int, pythonpath: Path) -> tuple[int, list[float], float]:
    """Run ``cmd`` as a fresh process group; the per-process peaks of its ``nproc`` workers (the largest
    processes under the launcher, or the process itself when it starts none) and the wall seconds."""
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // nproc)),
           "PYTHONPATH": os.pathsep.join([str(pythonpath), os.environ.get("PYTHONPATH", "")]),
           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    started = time.perf_counter()
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
        sampler = TreeSampler(proc.pid)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the job's own group: the launcher and its workers
            rc = proc.wait()
    sampler.ranks_mb(0)  # stops the sampler
    workers = {pid: kb for pid, kb in sampler.peak_kb.items() if pid != proc.pid}
    kbs = sorted(workers.values(), reverse=True)[:nproc] if workers else [sampler.peak_kb.get(proc.pid, 0)]
    return rc, [round(kb / 1024, 1) for kb in kbs], round(time.perf_counter() - started, 1)


def timed_speed(seconds: list[float], tokens: list[int]) -> float | None:
    """Tokens per second over the steps, step 1 left out as warm-up when there are more."""
    keep = slice(1, None) if len(seconds) > 1 else slice(None)
    return sum(tokens[keep]) / sum(seconds[keep]) if seconds else None


class Bench:
    """The runs of one invocation: the model, the records, the flags every row shares."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.cache = args, args.cache
        self.model = make_model(args.layers, args.cache)
        self.runs = args.cache / "runs"
        self.runs.mkdir(parents=True, exist_ok=True)
        self.budget = round(args.budget_gib * 1024)

    def records(self, tokens: int, n: int) -> Path:
        data = make_records(self.cache, tokens, n)
        check_records(self.model, data, tokens)
        return data

    def flags(self, tokens: int, nproc: int, strategy: str, records: int, packing: bool) -> list[str]:
        return ["--model", str(self.model), "--nproc", str(nproc), "--strategy", strategy, "--dtype", "fp32",
                "--seq-len", str(tokens), "--batch-size", str(records * nproc), "--micro-batch-size", "1",
                "--lora-r", str(LORA["r"]), "--lora-alpha", str(LORA["alpha"]), "--lora-targets", "all-linear",
                "--activation-checkpointing", *(["--packing"] if packing else [])]

    def row(self, recipe: str, tokens: int, cmd: list[str], nproc: int, out: Path, src: Path = ROOT / "src",
            steps: int | None = None) -> dict:
        load = loadavg()
        rc, peaks, wall = run_job(cmd, out / "log.txt", self.args.timeout, nproc, src)
        row = {"recipe": recipe, "tokens": tokens, "ranks": nproc, "records_per_row": 1,
               "steps": steps or self.args.steps, "command": shlex.join(cmd), "log": str(out / "log.txt"),
               "wall_seconds": wall, "loadavg_before": load, "peak_mb": peaks, "commit": git_commit(),
               "date": time.strftime("%Y-%m-%d", time.gmtime())}
        if rc:
            row["error"] = (out / "log.txt").read_text()[-2000:] or f"exit code {rc}"
        return row

    # -- shardtune's rows (shardtune, fsdp2, packed, ref, verify)

    def shardtune(self, recipe: str, tokens: int, steps: int | None = None) -> dict:
        nproc, strategy = (2, "fsdp2") if recipe == "fsdp2" else (1, "single")
        packs = self.args.pack_records if recipe == "packed" else 1
        steps = steps or self.args.steps
        data = self.records(tokens // packs, nproc * packs * steps)
        flags = self.flags(tokens, nproc, strategy, packs, recipe == "packed")
        extra = [] if recipe == "ref" else shlex.split(self.args.shardtune_flags)
        if recipe == "verify" and "--memory-per-rank" not in extra:  # as a user runs at the limit: auto choices see it
            extra += ["--memory-per-rank", f"{self.budget}MiB"]
        out = Path(tempfile.mkdtemp(prefix=f"{recipe}-{tokens}-", dir=self.runs))
        src, ref_dir = ROOT / "src", None
        if recipe == "ref":
            ref_dir = Path(tempfile.mkdtemp(prefix="ref-src-", dir=self.runs))
            src = export_src(self.args.compare_ref, ref_dir)
        cmd = [sys.executable, "-m", "shardtune", "finetune", *flags, *extra, "--data", str(data),
               "--out", str(out / "run"), "--steps", str(steps), "--warmup-steps", "0"]
        row = {**self.row(recipe, tokens, cmd, nproc, out, src, steps), "records_per_row": packs}
        if recipe == "ref":
            row["ref"] = self.args.compare_ref
        metrics, summary = out / "run" / "metrics.jsonl", out / "run" / "summary.json"
        if "error" not in row and metrics.is_file() and summary.is_file():
            steps_done = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
            done = json.loads(summary.read_text())
            row.update(step_seconds=[round(s["seconds"], 2) for s in steps_done],
                       tokens_per_second=timed_speed([s["seconds"] for s in steps_done],
                                                     [s["tokens"] for s in steps_done]),
                       summary_peak_mb=done.get("train_peak_mb"), loss_first=done.get("train_loss_first"),
                       fill_ratio=done.get("fill_ratio"), strategy=done.get("strategy"))
            if recipe != "ref":
                row["plan"] = self.plan([*flags, *extra, "--data", str(data)], strategy)
        elif "error" not in row:
            row["error"] = "no metrics.jsonl or summary.json: " + (out / "log.txt").read_text()[-1500:]
        if ref_dir is not None:
            shutil.rmtree(ref_dir, ignore_errors=True)
        return row

    def plan(self, flags: list[str], strategy: str) -> dict:
        """``shardtune plan --json`` for the row's flags: the prediction for its strategy and flags."""
        out = self.plan_json(flags)
        if "error" in out:
            return out
        entry = out.get(strategy) or {}
        if "peak_mb" not in entry:
            return {"error": f"no prediction for {strategy}: {json.dumps(entry)[:300]}"}
        return {"strategy": strategy, "peak_mb": entry["peak_mb"], "terms": entry.get("terms")}

    def plan_json(self, flags: list[str]) -> dict:
        proc = subprocess.run([sys.executable, "-m", "shardtune", "plan", *flags, "--json"], capture_output=True,
                              text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
        if proc.returncode:  # its last lines say why
            return {"error": "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])[-1000:]}
        return json.loads(proc.stdout)

    def plan_longest(self) -> dict:
        """``shardtune plan --seq-len max --memory-per-rank BUDGET --json``: the longest sequence that fits,
        for a single process. The flag is new (issue 32); the layouts read: {"single": {KEY: N}} or {KEY: {"single": N}}
        with KEY one of ``keys`` below; anything else keeps plan's JSON under "raw" and the measured line is used."""
        flags = self.flags(0, 1, "single", 1, False)
        flags[flags.index("--seq-len") + 1] = "max"
        out = self.plan_json([*flags, *shlex.split(self.args.shardtune_flags), "--memory-per-rank",
                              f"{self.budget}MiB"])
        if "error" in out:
            return {"error": out["error"], "note": "plan --seq-len max refused: the measured line is used"}
        keys = ("max_seq_len", "longest_seq_len", "seq_len_max", "longest", "seq_len")
        entry = out.get("single") if isinstance(out.get("single"), dict) else {}
        for key in keys:
            for value in (entry.get(key), (out.get(key) or {}).get("single") if isinstance(out.get(key), dict)
                          else out.get(key)):
                if isinstance(value, int) and not isinstance(value, bool):
                    return {"tokens": value, "key": key}
        return {"error": "no longest sequence found in plan's JSON", "raw": json.dumps(out)[:2000]}

    def replan(self, row: dict) -> dict:
        """The prediction for a measured shardtune row from the planner as it is now (the measurement keeps
        its own commit)."""
        flags = plan_flags(row["command"], self.model)
        return {**self.plan(flags, flags[flags.index("--strategy") + 1]), "commit": git_commit()}

    # -- the peers' rows

    def peer(self, recipe: str, tokens: int) -> dict:
        data = self.records(tokens, self.args.steps)
        out = Path(tempfile.mkdtemp(prefix=f"{recipe}-{tokens}-", dir=self.runs))
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", recipe, "--model", str(self.model),
               "--data", str(data), "--out", str(out), "--steps", str(self.args.steps), "--seq-len", str(tokens)]
        row = self.row(recipe, tokens, cmd, 1, out)
        result = out / "result.json"
        if "error" not in row and result.is_file():
            r = json.loads(result.read_text())
            row.update(step_seconds=[round(s, 2) for s in r["seconds"]], tokens_seen=r["tokens"],
                       tokens_per_second=timed_speed(r["seconds"], r["tokens"]), loss_first=r["loss_first"],
                       maxrss_mb=r["maxrss_mb"])
        elif "error" not in row:
            row["error"] = "no result.json: " + (out / "log.txt").read_text()[-1500:]
        return row


def export_src(commit: str, into: Path) -> Path:
    """src/ of ``commit`` under ``into`` (``git archive``: no worktree left behind); returns that src/."""
    archive = into / "src.tar"
    with archive.open("wb") as f:
        done = subprocess.run(["git", "archive", commit, "src"], cwd=ROOT, stdout=f, stderr=subprocess.PIPE, text=True)
    if done.returncode:
        raise SystemExit(f"--compare-ref {commit}: git archive failed: {done.stderr.strip()}")
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    src = into / "src"
    where = subprocess.run([sys.executable, "-c", "import shardtune; print(shardtune.__file__)"], capture_output=True,
                           text=True, env={**os.environ, "PYTHONPATH": str(src)}).stdout.strip()
    if not where.startswith(str(src)):  # an import hook of an installed shardtune would win over PYTHONPATH
        raise SystemExit(f"--compare-ref {commit}: python imports shardtune from {where or '?'}, not {src}")
    return src


# ---- the peers, each as its users write it (run as this script's --worker) --------------------------

def peer_worker(args: argparse.Namespace) -> None:
    import torch
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(args.model)
    lora = LoraConfig(r=LORA["r"], lora_alpha=LORA["alpha"], lora_dropout=0.0, target_modules="all-linear",
                      task_type="CAUSAL_LM")
    texts = [json.loads(line)["text"] for line in Path(args.data).read_text().splitlines() if line.strip()]
    train = trl_train if args.worker == "trl" else hf_train
    seconds, tokens, first = train(model, tok, lora, texts, args)
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    (Path(args.out) / "result.json").write_text(json.dumps({"seconds": seconds, "tokens": tokens, "loss_first": first,
                                                            "maxrss_mb": round(maxrss, 1)}))


def trl_train(model, tok, lora, texts: list[str], args: argparse.Namespace) -> tuple[list[float], list[int], float]:
    """TRL's SFTTrainer + a peft LoraConfig, its defaults (gradient checkpointing on, its "nll" loss)."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    step_times, seconds, logged = trainer_step_times()

    config = SFTConfig(output_dir=str(Path(args.out) / "trl"), per_device_train_batch_size=1,
                       gradient_accumulation_steps=1, max_steps=args.steps, max_length=args.seq_len,
                       learning_rate=2e-4, lr_scheduler_type="constant", warmup_steps=0, logging_steps=1,
                       save_strategy="no", report_to="none", use_cpu=True, bf16=False, dataloader_num_workers=0)
    trainer = SFTTrainer(model=model, args=config, train_dataset=Dataset.from_dict({"text": texts}),
                         processing_class=tok, peft_config=lora, callbacks=[step_times])
    tokens = [len(trainer.train_dataset[i % len(texts)]["input_ids"]) for i in range(args.steps)]
    trainer.train()
    return seconds, tokens, logged[0]["loss"] if logged else None


def hf_train(model, tok, lora, texts: list[str], args: argparse.Namespace) -> tuple[list[float], list[int], float]:
    """transformers + peft with gradient checkpointing and a hand loop: model(...).loss.backward()."""
    import torch
    from peft import get_peft_model

    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = get_peft_model(model, lora)
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-4)
    seconds, tokens, losses = [], [], []
    for step in range(args.steps):
        ids = torch.tensor([tok(texts[step % len(texts)])["input_ids"] + [tok.eos_token_id]])
        started = time.perf_counter()
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        seconds.append(time.perf_counter() - started)
        tokens.append(ids.shape[1])
        losses.append(loss.item())
    return seconds, tokens, losses[0]


# ---- the whole run -----------------------------------------------------------------------------------

def run_rows(bench: Bench, args: argparse.Namespace, wanted: list[str], rows: list[dict]) -> dict:
    """Run the wanted rows in order, each merged into ``rows`` as it ends; returns plan --seq-len max's answer."""

    def keep(row: dict) -> None:
        rows[:] = [r for r in rows if (r["recipe"], r["tokens"]) != (row["recipe"], row["tokens"])] + [row]
        brief = {k: v for k, v in row.items() if k not in ("command", "log", "error")}
        print(json.dumps(brief)[:500] + (f"\n  FAILED: {str(row['error']).strip()[-300:]}" if "error" in row else ""),
              flush=True)
        save(args, rows, None, None)

    for recipe in wanted:
        if recipe in ("shardtune", "trl", "hf", "fsdp2"):
            for tokens in args.lengths:
                print(f"running {recipe} at {tokens} tokens ...", flush=True)
                ours = recipe in ("shardtune", "fsdp2")
                keep(bench.shardtune(recipe, tokens) if ours else bench.peer(recipe, tokens))
        elif recipe in ("packed", "ref"):
            for tokens in (args.packed_lengths if recipe == "packed" else [args.speed_tokens]):
                print(f"running {recipe} at {tokens} tokens ...", flush=True)
                keep(bench.shardtune(recipe, tokens))
    longest = bench.plan_longest()
    if "verify" in wanted:
        tokens = longest.get("tokens") or derive(rows, None, bench.budget, args.speed_tokens)["longest_fit"].get(
            "shardtune", {}).get("tokens")
        if tokens and (tokens <= args.verify_max or args.quick):
            tokens = min(tokens, args.verify_max) // 64 * 64  # --quick: the path at a tiny length, not the estimate
            print(f"running verify at {tokens} tokens ...", flush=True)
            keep({**bench.shardtune("verify", tokens), "budget_mb": bench.budget})
        else:
            print(f"verify: skipped (longest within the budget: {tokens}; --verify-max {args.verify_max})")
    return longest


def results_path(args: argparse.Namespace) -> Path:
    if args.out:
        return args.out
    if args.quick:
        return args.cache / f"long-context-{args.layers}l-quick.json"
    return HERE / "results" / f"long-context-{args.layers}l.json"


def save(args: argparse.Namespace, rows: list[dict], figures: dict | None, extra: dict | None) -> None:
    path = results_path(args)
    data = {"layers": args.layers, "shape": {**SMOLLM2, "num_hidden_layers": args.layers}, "dtype": "fp32",
            "lora": f"r{LORA['r']} alpha {LORA['alpha']} all-linear", "steps": args.steps,
            "shardtune_flags": args.shardtune_flags, "budget_mb": round(args.budget_gib * 1024),
            "speed_tokens": args.speed_tokens, "compare_ref": args.compare_ref, "quick": args.quick,
            "rows": sorted(rows, key=order), **({"figures": figures} if figures is not None else {}), **run_record(),
            **(extra or {})}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4, help="decoder layers: 4 (issue 32's table) or 30 [4]")
    parser.add_argument("--rows", default=",".join(ROWS), help="comma-separated, run in this order: " + ", ".join(ROWS))
    parser.add_argument("--lengths", default="2048,4096,8192,16384", help="tokens per record [2048,...,16384]")
    parser.add_argument("--steps", type=int, default=2, help="steps per job; the first is warm-up when more [2]")
    parser.add_argument("--speed-tokens", type=int, default=8192, help="the length of the ref comparison [8192]")
    parser.add_argument("--packed-lengths", default="8192", help="row lengths of the packed rows [8192]")
    parser.add_argument("--pack-records", type=int, default=4, help="records packed into one row [4]")
    parser.add_argument("--compare-ref", default=DEFAULT_REF, help=f"commit of the ref row [{DEFAULT_REF}]")
    parser.add_argument("--budget-gib", type=float, default=4.0, help="memory per process for the fit targets [4]")
    parser.add_argument("--verify-max", type=int, default=32768, help="verify only a fit up to this length [32768]")
    parser.add_argument("--shardtune-flags", default="", help="more flags for shardtune's rows (not ref)")
    parser.add_argument("--timeout", type=int, default=4 * 3600, help="seconds per job")
    parser.add_argument("--quick", action="store_true", help="lengths 128,256, packed and ref at 256, verify at 512")
    parser.add_argument("--fresh", action="store_true", help="drop the rows of an earlier run of this file")
    parser.add_argument("--replan", action="store_true",
                        help="run no job: predict the measured shardtune rows again with the planner as it is now")
    parser.add_argument("--cache", type=Path, default=HERE / ".cache")
    parser.add_argument("--out", type=Path, default=None,
                        help="default: bench/results/long-context-<layers>l.json (--quick: under --cache)")
    parser.add_argument("--worker", choices=("trl", "hf"), help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("--seq-len", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        peer_worker(args)
        return
    if args.quick:
        args.lengths, args.packed_lengths, args.speed_tokens, args.verify_max = "128,256", "256", 256, 512
    args.lengths = [int(t) for t in args.lengths.split(",")]
    args.packed_lengths = [int(t) for t in args.packed_lengths.split(",")]
    wanted = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = sorted(set(wanted) - set(ROWS))
    if unknown:
        parser.error(f"--rows: unknown {', '.join(unknown)} (known: {', '.join(ROWS)})")
    import torch

    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        print("note: this CPU computes bf16 natively; the bench stays in fp32, as issue 32's table", flush=True)
    path = results_path(args)
    if args.replan and (args.fresh or not path.is_file()):
        why = "--fresh drops them" if args.fresh else "no such file"
        parser.error(f"--replan predicts the measured rows of {path} again: {why}")
    earlier = {} if args.fresh or not path.is_file() else json.loads(path.read_text())
    rows, note = earlier.get("rows", []), earlier.get("note")  # a note on how the rows were measured stays
    bench = Bench(args)
    if args.replan:
        for row in rows:
            if row["recipe"] in ("shardtune", "packed", "fsdp2", "verify") and "plan" in row:
                row["plan"] = bench.replan(row)
                print(f"replanned {row['recipe']} at {row['tokens']} tokens: {row['plan'].get('peak_mb')} MB")
        wanted = []
    longest = run_rows(bench, args, wanted, rows)
    lengths = sorted({r["tokens"] for r in rows if r["recipe"] == "shardtune"})[-2:]
    the_floor = floor(bench.model, (lengths[0], lengths[1]) if len(lengths) == 2 else (2048, 4096))
    figures = derive(rows, the_floor, bench.budget, args.speed_tokens, longest)
    lines = verdicts(figures, the_floor, args.layers, "fp32")
    print("\n".join(["", *table(rows), "", *figure_lines(figures, the_floor), "", *lines]))
    measured = {}  # --replan: the file stays the record of the runs that measured it; the planner's is beside it
    if args.replan:
        measured = {**{k: earlier[k] for k in ("machine", "command", "commit", "date", "steps") if k in earlier},
                    "replanned": replan_record()}
    save(args, rows, figures, {"floor": the_floor, "plan_longest": longest, "targets": lines,
                               **({"note": note} if note else {}), **measured})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
