"""A hostile new user's sweep: bad options, paths, configs, models and run folders through `python -m shardtune`.

Each case runs the real command in a fresh process (timeout: a hang is a verdict, not a wait) and is
judged: good (the expected exit code, the expected words in the message, no traceback, and the
protected files unchanged), weak (right code, the message misses the words), bad (a traceback, a
hang, a silent success, or something lost). A case may also stop its command inside its write
(SHARDTUNE_TEST_FAIL_AT=stop@write) and send it a signal, run it while another writer stopped the same
way holds its output, and check what is left on disk afterwards (a temporary, a lock, an adapter from
garbage weights): a failed check is "bad" too. Prints a table and writes bench/results/hostile-sweep.json
after every case (scripts/gen_benchmarks.py renders it in docs/benchmarks.md).

    nice -n 19 python bench/hostile_sweep.py [--only SUBSTRING ...] [--list] [--merge FILE ...]

``--only`` runs a part and merges its verdicts into the file, so a long sweep can run in parts (also
in several checkouts at once, whose files ``--merge`` then brings together).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests"), str(ROOT / "bench")]

import torch  # noqa: E402

from record import run_record  # noqa: E402

from tiny import SMOLLM2_CHAT_TEMPLATE, instruction_records, make_model, write_jsonl  # noqa: E402

TIMEOUT = 240  # seconds a case may take before it counts as a hang (--timeout: a machine under load)


@dataclass
class Case:
    name: str
    args: Callable[[Path], list[str]]  # the argv after `python -m shardtune`, from the sweep's root
    code: int = 2
    words: str = ""  # must appear in stderr
    setup: Callable[[Path], None] | None = None
    env: dict = field(default_factory=dict)
    keep: Callable[[Path], Path] | None = None  # a folder that must be unchanged afterwards
    check: Callable[[Path], str | None] | None = None  # afterwards: what went wrong (a "bad" verdict), or None
    # The command is stopped inside its write (SHARDTUNE_TEST_FAIL_AT=stop@write), then sent this signal.
    signal: int | None = None
    # Another writer, started first and stopped inside its write, holds the output meanwhile; it is then
    # sent SIGTERM and must end with 128 + SIGTERM.
    holder: Callable[[Path], list[str]] | None = None


def _snapshot(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def ft(*extra: str, model: str = "model", data: str = "train.jsonl", out: str = "out") -> Callable[[Path], list[str]]:
    def argv(r: Path) -> list[str]:
        return ["finetune", "--model", str(r / model), "--data", str(r / data), "--out", str(r / out),
                "--steps", "1", "--batch-size", "4", "--seq-len", "64", "--dtype", "fp32",
                *[a.replace("{r}", str(r)) for a in extra]]
    return argv


def _fifo(name: str) -> Callable[[Path], None]:
    return lambda r: (r / name).exists() or os.mkfifo(r / name)


def _socket(r: Path) -> None:
    if not (r / "sock").exists():
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(r / "sock"))


def _model_variant(name: str, change: Callable[[Path], None]) -> Callable[[Path], None]:
    def setup(r: Path) -> None:
        make_model(r / name, "llama")
        change(r / name)
    return setup


def _tensors(change) -> Callable[[Path], None]:
    def apply(model: Path) -> None:
        from safetensors.torch import load_file, save_file

        t = load_file(model / "model.safetensors")
        change(t)
        save_file(t, model / "model.safetensors", metadata={"format": "pt"})
    return apply


def _config(**values) -> Callable[[Path], None]:
    def apply(model: Path) -> None:
        cfg = json.loads((model / "config.json").read_text())
        cfg.update(values)
        (model / "config.json").write_text(json.dumps(cfg))
    return apply


def _bad_index(r: Path) -> None:
    make_model(r / "sharded", "llama", sharded=True)
    index_file = r / "sharded" / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    files = sorted(set(index["weight_map"].values()))
    index["weight_map"] = {n: files[0] for n in index["weight_map"]}
    index_file.write_text(json.dumps(index))


def _yaml(name: str, text: str) -> Callable[[Path], None]:
    return lambda r: (r / name).write_text(text.replace("{r}", str(r)))


# Every command that reads an adapter, as (argv from the sweep's root, the adapter folder's name).
ADAPTER_COMMANDS = ("merge", "export", "export --check vllm", "generate", "eval", "--init-adapter")


def _with_adapter(command: str, adapter: str) -> Callable[[Path], list[str]]:
    """``command`` reading ``adapter``; what it writes goes to its own folder, ``_written_by(command, adapter)``."""
    def argv(r: Path) -> list[str]:
        a, model, folder = str(r / adapter), str(r / "model"), _written_by(command, adapter)(r)
        folder.mkdir(parents=True, exist_ok=True)
        return {"merge": ["merge", "--model", model, "--adapter", a, "--out", str(folder / "m")],
                "export": ["export", "--model", model, "--adapter", a, "--out", str(folder / "m.gguf")],
                "export --check vllm": ["export", "--adapter", a, "--check", "vllm"],
                "generate": ["generate", "--model", model, "--adapter", a, "--prompt", "hi"],
                "eval": ["eval", "--model", model, "--adapter", a, "--data", str(r / "train.jsonl")],
                "--init-adapter": ft("--init-adapter", a, out=str(folder / "run"))(r)}[command]
    return argv


def _written_by(command: str, adapter: str) -> Callable[[Path], Path]:
    return lambda r: r / f"w-{adapter}-{command.strip('-').replace(' ', '').replace('-', '')}"


def _nothing_written(command: str, adapter: str) -> Callable[[Path], str | None]:
    return lambda r: _only(_written_by(command, adapter)(r), [])


def _adapter_variant(name: str, change: Callable[[dict], None]) -> Callable[[Path], None]:
    """A copy of the finished run's adapter with its tensors changed."""
    def setup(r: Path) -> None:
        import shutil

        from safetensors.torch import load_file, save_file

        shutil.rmtree(r / name, ignore_errors=True)
        shutil.copytree(r / "finished" / "adapter", r / name)
        tensors = load_file(r / name / "adapter_model.safetensors")
        change(tensors)
        save_file(tensors, r / name / "adapter_model.safetensors", metadata={"format": "pt"})
    return setup


def _one_nan(tensors: dict) -> None:
    name = sorted(k for k in tensors if ".lora_B." in k)[0]
    tensors[name] = tensors[name].clone().view(-1).index_fill(0, torch.tensor([0]), float("nan")).view_as(tensors[name])


def _only(folder: Path, names: list[str]) -> str | None:
    """None when ``folder`` holds exactly ``names`` (hidden temporaries and locks included), else what it holds."""
    found = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
    return None if found == sorted(names) else f"{folder} holds {found}, expected {sorted(names)}"


def _absent(path: Path) -> str | None:
    return f"{path} was written" if path.exists() else None


def _identical_pairs(r: Path) -> None:
    write_jsonl(r / "same-pairs.jsonl", [{"prompt": f"q{i}", "chosen": "a", "rejected": "a"} for i in range(8)])


def _merge(name: str) -> Callable[[Path], list[str]]:
    """A merge of the finished run's adapter into ``w-NAME/merged``."""
    return lambda r: ["merge", "--model", str(r / "model"), "--adapter", str(r / "finished" / "adapter"), "--out",
                      str(r / f"w-{name}" / "merged")]


def _export(folder: str, name: str) -> Callable[[Path], list[str]]:
    def argv(r: Path) -> list[str]:
        (r / folder).mkdir(exist_ok=True)
        return ["export", "--model", str(r / "model"), "--adapter", str(r / "finished" / "adapter"), "--out",
                str(r / folder / f"{name}.gguf")]
    return argv


def _run(argv: list[str]) -> None:
    subprocess.run([sys.executable, "-m", "shardtune", *argv], check=True, capture_output=True)


def _own_modelfiles(r: Path) -> str | None:
    for name in ("first", "second"):
        text = (r / "two" / f"{name}.Modelfile").read_text() if (r / "two" / f"{name}.Modelfile").is_file() else ""
        if not text.startswith(f"FROM ./{name}.gguf"):
            return f"{name}.Modelfile does not name {name}.gguf"
    return None


def _copy(r: Path, src: str, dst: str) -> None:
    import shutil

    shutil.rmtree(r / dst, ignore_errors=True)
    shutil.copytree(r / src, r / dst)


def _killed_merge_leftovers(r: Path) -> None:
    """What a merge killed by SIGKILL mid-write leaves: its temporary folder and its lock, of a dead pid."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid, folder = int(dead.stdout), r / "w-killed"
    (folder / f".merged.tmp-{pid}").mkdir(parents=True, exist_ok=True)
    (folder / f".merged.tmp-{pid}" / "model.safetensors").write_bytes(b"\0" * 4096)
    (folder / ".merged.lock").write_text(json.dumps({"run": "merge-x", "host": socket.gethostname(), "pid": pid,
                                                     "started": time.time()}))


def _torn_run(r: Path) -> None:
    _copy(r, "ckpt", "torn")
    with (r / "torn" / "metrics.jsonl").open("ab") as f:
        f.write(b'{"step": 2, "loss": 2.3, "lr": 0.0')


def _torn_report(r: Path) -> None:
    _copy(r, "finished", "torn-report")
    with (r / "torn-report" / "metrics.jsonl").open("ab") as f:
        f.write(b"\0" * 512)  # a power loss's zeros


SLEEPERS: list[subprocess.Popen] = []


def _reused_pid_lock(r: Path) -> None:
    """A lock an hour old whose pid now belongs to an unrelated process (`sleep`), as after a restart."""
    SLEEPERS.append(subprocess.Popen(["sleep", "600"]))
    (r / "stale-lock").mkdir(exist_ok=True)
    (r / "stale-lock" / ".lock").write_text(json.dumps({"run": "old", "host": socket.gethostname(),
                                                        "pid": SLEEPERS[-1].pid, "started": time.time() - 3600}))


GRPO_REWARDS = """
import sys
def beyond_float32(prompts, completions, **kwargs):
    return [1e39] * len(completions)
def never(prompts, completions, **kwargs):
    return [None] * len(completions)
def exits(prompts, completions, **kwargs):
    sys.exit(0)
def narrow(completions):
    return [0.0] * len(completions)
def constant(prompts, completions, **kwargs):
    return [1.0] * len(completions)
"""


def _grpo_files(r: Path) -> None:
    write_jsonl(r / "prompts.jsonl", [{"prompt": f"What is {i}+{i}?", "answer": str(2 * i)} for i in range(8)])
    (r / "rewards.py").write_text(GRPO_REWARDS)
    write_jsonl(r / "questions.jsonl", [{"question": f"What is {i}+{i}?"} for i in range(8)])


def grpo(reward: str, *extra: str, data: str = "prompts.jsonl") -> Callable[[Path], list[str]]:
    """A GRPO fine-tune on ``data`` (the sweep's prompts) with one reward function of GRPO_REWARDS."""
    return ft("--objective", "grpo", "--reward", f"{{r}}/rewards.py:{reward}", "--num-generations", "4",
              "--batch-size", "8", "--max-completion-length", "4", "--strategy", "single", *extra,
              data=data, out="grpo")


def _one_schedule(r: Path) -> str | None:
    """The resumed steps' rates are this run's schedule (3 steps, no warmup) at those steps (docs/checkpoints.md)."""
    import math

    from shardtune.train.schedule import lr_factor

    metrics = [json.loads(line) for line in (r / "longer" / "metrics.jsonl").read_text().splitlines()]
    wrong = [(m["step"], m["lr"]) for m in metrics[1:]
             if not math.isclose(m["lr"], 2e-4 * lr_factor(m["step"] - 1, 3, 0, 0.1))]
    return f"resumed steps off the schedule: {wrong}" if wrong else None


CASES = [
    # --- numeric options out of range --------------------------------------------------------------
    *[Case(f"--{flag} {value}", ft(f"--{flag}={value}"), words=f"option '{flag}'") for flag, value in [
        ("weight-decay", "-1"), ("max-grad-norm", "-1"), ("warmup-steps", "-5"), ("min-lr-ratio", "5"),
        ("min-lr-ratio", "-0.1"), ("save-every", "-1"), ("eval-every", "-3"), ("lora-alpha", "0"),
        ("lora-alpha", "-16"), ("lora-dropout", "1.0"), ("lora-dropout", "-0.1"), ("keep-last", "0"),
        ("seed", "-1"), ("seed", "99999999999"), ("collective-timeout", "0"), ("collective-timeout", "1e9"),
        ("epochs", "-1"), ("lr", "0"), ("lr", "-1e-3"), ("lr", "nan"), ("lr", "inf"), ("nproc", "0"),
        ("replicate-groups", "0"), ("node-rank", "-1"), ("seq-len", "0"), ("micro-batch-size", "0"),
        ("lora-r", "-4"), ("batch-size", "0")]],
    Case("--strategy single --nproc 2", ft("--strategy", "single", "--nproc", "2"), words="option 'strategy'"),
    Case("--nnodes 2 without --rdzv-endpoint", ft("--nnodes", "2"), words="option 'rdzv-endpoint'"),
    Case("--report-to nosuch", ft("--report-to", "nosuch"), words="report-to"),
    Case("--report-to wandb without a login", ft("--report-to", "wandb"), words="wandb has no login",
         env={"WANDB_MODE": "", "WANDB_API_KEY": "", "NETRC": "/nonexistent"}),
    # --- YAML configs ------------------------------------------------------------------------------
    Case("YAML key given twice", lambda r: ["finetune", "--config", str(r / "dup.yaml")], words="dup.yaml:3",
         setup=_yaml("dup.yaml", "model: {r}/model\nlora-r: 4\nlora-r: 16\n")),
    Case("YAML lora_r and lora-r", lambda r: ["finetune", "--config", str(r / "dup2.yaml")],
         words="given twice", setup=_yaml("dup2.yaml", "lora_r: 4\nlora-r: 16\n")),
    Case("YAML key twice in a section", lambda r: ["finetune", "--config", str(r / "dup3.yaml")],
         words="dup3.yaml:3", setup=_yaml("dup3.yaml", "lora:\n  r: 4\n  r: 8\n")),
    Case("YAML that is a list", lambda r: ["finetune", "--config", str(r / "list.yaml")],
         words="expected a mapping", setup=_yaml("list.yaml", "- a\n- b\n")),
    Case("--config a FIFO", lambda r: ["finetune", "--config", str(r / "cfg.fifo")], words="named pipe",
         setup=_fifo("cfg.fifo")),
    Case("--config /dev/zero", lambda r: ["finetune", "--config", "/dev/zero"], words="device file"),
    # --- paths -------------------------------------------------------------------------------------
    Case("--data a FIFO", ft(data="data.fifo"), words="option 'data'", setup=_fifo("data.fifo")),
    Case("--data /dev/zero", lambda r: ft()(r)[:3] + ["--data", "/dev/zero"] + ft()(r)[5:], words="device file"),
    Case("--data a socket", ft(data="sock"), words="socket", setup=_socket),
    Case("--data in a missing folder", ft(data="nowhere/train.jsonl"), words="does not exist"),
    Case("--val-data a FIFO", ft("--val-data", "{r}/val.fifo"), words="option 'val-data'", setup=_fifo("val.fifo")),
    Case("--val-data an empty directory", ft("--val-data", "{r}/emptydir"), words="is a folder with no data files",
         setup=lambda r: (r / "emptydir").mkdir(exist_ok=True)),
    Case("--model a FIFO", ft(model="model.fifo"), words="option 'model'", setup=_fifo("model.fifo")),
    Case("--model a file", ft(model="train.jsonl"), words="option 'model'"),
    Case("--log-file in a missing folder", ft("--log-file", "{r}/no/such/run.log"), words="option 'log-file'"),
    Case("--log-file a directory", ft("--log-file", "{r}"), words="option 'log-file'"),
    Case("--log-file a FIFO", ft("--log-file", "{r}/log.fifo"), words="option 'log-file'", setup=_fifo("log.fifo")),
    Case("--out an existing file", ft(out="train.jsonl"), words="option 'out'"),
    Case("--out equal to the model dir", ft(out="model"), words="model directory", keep=lambda r: r / "model"),
    Case("--out inside the model dir", ft(out="model/run"), words="inside the model directory",
         keep=lambda r: r / "model"),
    Case("--out under a file", ft(out="train.jsonl/out"), words="option 'out'"),
    Case("$SHARDTUNE_CACHE a file", ft(), words="token cache", env={"SHARDTUNE_CACHE": "{r}/train.jsonl"}),
    # --- lost work ---------------------------------------------------------------------------------
    Case("--resume on a finished run without checkpoints", ft("--resume", out="finished"),
         words="no complete checkpoint", keep=lambda r: r / "finished"),
    Case("finetune again on a finished --out", ft(out="finished"), words="holds a finished run",
         keep=lambda r: r / "finished"),
    Case("--resume --overwrite together", ft("--resume", "--overwrite", out="finished"), words="contradict",
         keep=lambda r: r / "finished"),
    Case("resume with another --lora-r", ft("--resume", "--lora-r", "4", "--save-every", "1", out="ckpt"),
         words="option 'lora-r' was", keep=lambda r: r / "ckpt"),
    Case("adapter-from-checkpoint, data zeroed", lambda r: ["adapter-from-checkpoint", str(r / "zeroed" / "step-1"),
                                                            str(r / "adapter-out")], words="failed",
         setup=lambda r: _zeroed_checkpoint(r)),
    # --- models ------------------------------------------------------------------------------------
    Case("int8 tensor in a float checkpoint", ft(model="int8"), words="is stored as I8",
         setup=_model_variant("int8", _tensors(lambda t: t.__setitem__(
             "model.layers.0.mlp.up_proj.weight", t["model.layers.0.mlp.up_proj.weight"].to(torch.int8))))),
    Case("weight shape against config.json", ft(model="shape"), words="but config.json gives",
         setup=_model_variant("shape", _tensors(lambda t: t.__setitem__(
             "model.layers.1.self_attn.o_proj.weight", t["model.layers.1.self_attn.o_proj.weight"][:, :16].clone())))),
    Case("a weight missing", ft(model="missing"), words="has no tensor for",
         setup=_model_variant("missing", _tensors(lambda t: t.pop("model.layers.0.mlp.down_proj.weight")))),
    Case("tokenizer larger than vocab_size", ft(model="vocab"), words="the tokenizer has",
         setup=_model_variant("vocab", _config(vocab_size=200))),
    Case("config.json heads not dividing hidden", ft(model="heads"), words="config.json",
         setup=_model_variant("heads", _config(num_attention_heads=5))),
    Case("config.json not JSON", ft(model="notjson"), words="not valid JSON",
         setup=_model_variant("notjson", lambda m: (m / "config.json").write_text("{oops"))),
    Case("merge with an index at the wrong shard",
         lambda r: ["merge", "--model", str(r / "sharded"), "--adapter", str(r / "finished" / "adapter"),
                    "--out", str(r / "merged")], words="do not hold them", setup=_bad_index),
    Case("generate with a FIFO adapter_config.json",
         lambda r: ["generate", "--model", str(r / "model"), "--adapter", str(r / "fifo-adapter"), "--prompt", "x"],
         words="adapter_config.json", setup=lambda r: ((r / "fifo-adapter").mkdir(exist_ok=True),
                                                       _fifo("fifo-adapter/adapter_config.json")(r))),
    # --- resumable state against what it was made from ----------------------------------------------
    Case("resume against another base model", ft("--resume", "--save-every", "1", model="wider", out="ckpt"),
         words="another base model than --model", keep=lambda r: r / "ckpt",
         setup=lambda r: (r / "wider").exists() or make_model(r / "wider", "llama", hidden=64)),
    Case("resume a checkpoint that predates the model record", ft("--resume", "--steps", "2", "--save-every", "1",
                                                                   "--strategy", "single", out="oldckpt"),
         code=0, words="does not record its base model", setup=lambda r: _without_model_record(r)),
    Case("--resume in an empty --out", ft("--resume", "--strategy", "single", out="emptyout"), code=0,
         words="nothing to resume in", setup=lambda r: (r / "emptyout").mkdir(exist_ok=True)),
    # --- training that goes wrong ------------------------------------------------------------------
    Case("--lr 1e6 in bf16: finite loss, zero gradient", ft("--dtype", "bf16", "--lr", "1e6", "--warmup-steps", "0",
                                                            "--steps", "4", "--strategy", "single", out="blowup"),
         words="training diverged at step", check=lambda r: _absent(r / "blowup" / "adapter")),
    Case("--lr 1e6 in fp32: non-finite gradient", ft("--lr", "1e6", "--warmup-steps", "0", "--steps", "4",
                                                     "--strategy", "single", out="nonfinite"),
         words="training diverged at step"),
    # --- writes during training --------------------------------------------------------------------
    Case("full disk at metrics.jsonl", ft("--steps", "3", "--save-every", "1", "--strategy", "single", out="fullm"),
         words="metrics.jsonl: no space left", env={"SHARDTUNE_TEST_FAIL_AT": "full@metrics.jsonl:2"}),
    Case("full disk under the tensorboard tracker", ft("--steps", "2", "--report-to", "tensorboard", "--strategy",
                                                       "single", out="fulltb"),
         code=0, words="--report-to tensorboard stopped working", env={"SHARDTUNE_TEST_FAIL_AT": "full@tensorboard:1"}),
    # --- safety net --------------------------------------------------------------------------------
    Case("unexpected exception in preflight", ft(out="crash-pre"), code=3, words="in stage 'preflight'",
         env={"SHARDTUNE_TEST_FAIL_AT": "preflight"}),
    Case("unexpected exception while training", ft("--strategy", "single", out="crash-train"), code=3,
         words="error-traceback.txt", env={"SHARDTUNE_TEST_FAIL_AT": "train"}),
    # --- garbage out: a detected fault never ends in exit 0 ------------------------------------------
    Case("--lr 1e30", ft("--lr", "1e30", "--steps", "4", "--save-every", "1", "--strategy", "single", out="lr1e30"),
         words="training diverged at step", check=lambda r: _absent(r / "lr1e30" / "adapter")),
    *[Case(f"{command} an adapter of no tensors", _with_adapter(command, "empty-adapter"), words="holds no tensors",
           setup=_adapter_variant("empty-adapter", lambda t: t.clear()),
           check=_nothing_written(command, "empty-adapter")) for command in ADAPTER_COMMANDS],
    *[Case(f"{command} an adapter with NaN", _with_adapter(command, "nan-adapter"), words=".lora_B.weight holds 1 "
           "non-finite", setup=_adapter_variant("nan-adapter", _one_nan),
           check=_nothing_written(command, "nan-adapter")) for command in ("merge", "export", "--init-adapter")],
    Case("merge an adapter whose update overflows", _with_adapter("merge", "huge-adapter"),
         words="not finite once the adapter's update is added", check=_nothing_written("merge", "huge-adapter"),
         setup=_adapter_variant("huge-adapter", lambda t: t.update({k: v * 1e30 for k, v in t.items()}))),
    Case("DPO with chosen == rejected in every pair", ft("--objective", "dpo", data="same-pairs.jsonl", out="same"),
         words="the chosen and the rejected response are the same", setup=_identical_pairs),
    # --- GRPO: reward functions and sampling that leave nothing to learn ------------------------------
    Case("GRPO reward beyond float32", grpo("beyond_float32"), words="beyond float32's range", setup=_grpo_files,
         check=lambda r: _absent(r / "grpo" / "adapter")),
    Case("GRPO reward None for every completion", grpo("never"), setup=_grpo_files,
         words="no completion of the generation batch at step 1 got a reward",
         check=lambda r: _absent(r / "grpo" / "adapter")),
    Case("GRPO reward calling sys.exit(0)", grpo("exits"), words="SystemExit: 0", setup=_grpo_files),
    Case("GRPO reward without TRL's arguments", grpo("narrow"), setup=_grpo_files,
         words="cannot take the arguments reward functions get"),
    Case("GRPO constant reward: nothing learned", grpo("constant", "--steps", "2"), setup=_grpo_files,
         words="the run learned nothing in its 2 step(s)", check=lambda r: _absent(r / "grpo" / "adapter")),
    Case("GRPO --reward-weights 0", grpo("constant", "--reward-weights", "0"), words="weighs every --reward 0",
         setup=_grpo_files),
    Case("GRPO --temperature 0", grpo("never", "--temperature", "0"), words="samples greedily", setup=_grpo_files),
    Case("GRPO --top-k 1", grpo("never", "--top-k", "1"), words="samples greedily", setup=_grpo_files),
    Case("GRPO on records without a prompt", grpo("never", data="questions.jsonl"), words="no 'prompt' field",
         setup=_grpo_files),
    Case("eval --reward None for every prompt", lambda r: [
        "eval", "--model", str(r / "model"), "--data", str(r / "prompts.jsonl"), "--reward",
        f"{r / 'rewards.py'}:never", "--max-new-tokens", "2"],
         words="no completion of the held-out prompts got a reward", setup=_grpo_files),
    Case("--eval-every without --val-data", ft("--eval-every", "2", out="evalevery"), words="option 'eval-every'"),
    Case("--resume of a finished run", ft("--resume", "--save-every", "1", out="ckpt"), words="has finished all its",
         keep=lambda r: r / "ckpt"),
    # --- outputs that overwrite inputs -------------------------------------------------------------
    Case("export --force over the trained adapter", lambda r: [
        "export", "--model", str(r / "model"), "--adapter", str(r / "finished" / "adapter"), "--force", "--out",
        str(r / "finished" / "adapter" / "adapter_model.safetensors")], words="is inside the adapter",
         keep=lambda r: r / "finished"),
    Case("export --force over the base model", lambda r: [
        "export", "--model", str(r / "model"), "--force", "--out", str(r / "model" / "model.safetensors")],
         words="is inside the model directory", keep=lambda r: r / "model"),
    Case("merge into the base model's folder", lambda r: [
        "merge", "--model", str(r / "model"), "--adapter", str(r / "finished" / "adapter"), "--out",
        str(r / "model" / "merged")], words="is inside the model directory", keep=lambda r: r / "model"),
    Case("eval --out inside the adapter", lambda r: [
        "eval", "--model", str(r / "model"), "--adapter", str(r / "finished" / "adapter"), "--data",
        str(r / "train.jsonl"), "--out", str(r / "finished" / "adapter" / "eval.json")],
         words="is inside the adapter", keep=lambda r: r / "finished"),
    Case("adapter-from-checkpoint into its checkpoint", lambda r: [
        "adapter-from-checkpoint", str(r / "ckpt" / "checkpoints" / "step-1"),
        str(r / "ckpt" / "checkpoints" / "step-1" / "adapter")], words="is inside the checkpoint",
         keep=lambda r: r / "ckpt"),
    Case("adapter-from-checkpoint into the rotated checkpoints", lambda r: [
        "adapter-from-checkpoint", str(r / "ckpt" / "checkpoints" / "step-1"),
        str(r / "ckpt" / "checkpoints" / "extracted")], words="whose checkpoints shardtune rotates",
         keep=lambda r: r / "ckpt"),
    Case("a second export into the same folder", _export("two", "second"), code=0, words="",
         setup=lambda r: _run(_export("two", "first")(r)), check=_own_modelfiles),
    Case("two merges of one --out at once", _merge("concurrent"), words="is in use by another run",
         holder=_merge("concurrent"), check=lambda r: _only(r / "w-concurrent", [])),
    Case("two exports of one --out at once", _export("concurrent", "c"), words="is in use by another run",
         holder=_export("concurrent", "c"), check=lambda r: _only(r / "concurrent", [])),
    # --- interrupted writes and crash artefacts ----------------------------------------------------
    Case("SIGTERM during merge", _merge("term"), code=143, words="stopped by SIGTERM while writing",
         signal=signal.SIGTERM, check=lambda r: _only(r / "w-term", [])),
    Case("SIGTERM during export", _export("term", "t"), code=143, words="stopped by SIGTERM while writing",
         signal=signal.SIGTERM, check=lambda r: _only(r / "term", [])),
    Case("SIGTERM during adapter-from-checkpoint", lambda r: [
        "adapter-from-checkpoint", str(r / "ckpt" / "checkpoints" / "step-1"), str(r / "w-extract" / "adapter")],
         code=143, words="stopped by SIGTERM while writing", signal=signal.SIGTERM,
         check=lambda r: _only(r / "w-extract", [])),
    Case("merge after a SIGKILLed merge", _merge("killed"), code=0, words="", setup=_killed_merge_leftovers,
         check=lambda r: _only(r / "w-killed", ["merged"])),
    Case("--resume with a torn metrics.jsonl line", ft("--resume", "--steps", "2", "--strategy", "single", out="torn"),
         code=0, words="was cut off by an interrupted write", setup=_torn_run),
    Case("report with a torn metrics.jsonl line", lambda r: ["report", str(r / "torn-report")], code=0,
         words="was cut off by an interrupted write", setup=_torn_report),
    Case("a stale .lock whose pid is another process now", ft("--strategy", "single", out="stale-lock"), code=0,
         words="which is gone: pid", setup=_reused_pid_lock),
    Case("--log-file on a full disk (/dev/full)", ft("--strategy", "single", "--log-file", "/dev/full", out="devfull"),
         words="cannot write /dev/full: no space left on the device"),
    Case("--resume with a larger --steps follows one schedule", ft("--resume", "--steps", "3", "--strategy", "single",
                                                                   out="longer"),
         code=0, words="option 'steps' changed from 1 to 3", setup=lambda r: _copy(r, "ckpt", "longer"),
         check=_one_schedule),
]


# --- helpers of the cases of issue 35's classes 4-6 -------------------------------------------------------


def _other_base(r: Path) -> None:
    """The sweep's model's architecture, config and shapes, other weights: another training of the same model."""
    if not (r / "other").exists():
        make_model(r / "other", "llama", seed=1)


def _meets(command: str, model: str, adapter: str = "finished/adapter", into: str = ""
           ) -> Callable[[Path], list[str]]:
    """``command`` with ``adapter`` on base ``model``; what it writes goes to ``into`` (default w-base-COMMAND)."""
    def argv(r: Path) -> list[str]:
        a, m, folder = str(r / adapter), str(r / model), r / (into or _base_folder(command))
        folder.mkdir(exist_ok=True)
        return {"merge": ["merge", "--model", m, "--adapter", a, "--out", str(folder / "m")],
                "export": ["export", "--model", m, "--adapter", a, "--out", str(folder / "m.gguf")],
                "generate": ["generate", "--model", m, "--adapter", a, "--prompt", "hi"],
                "eval": ["eval", "--model", m, "--adapter", a, "--data", str(r / "train.jsonl")],
                "--init-adapter": ft("--init-adapter", a, model=model, out=str(folder / "run"))(r)}[command]
    return argv


def _base_folder(command: str) -> str:
    return f"w-base-{command.strip('-').replace('-', '')}"


def _copy_model(name: str, change: Callable[[Path], None] | None = None) -> Callable[[Path], None]:
    def setup(r: Path) -> None:
        _copy(r, "model", name)
        if change:
            change(r / name)
    return setup


def _unrecorded_adapter(r: Path) -> None:
    """The finished run's adapter as peft saves one: no base model recorded."""
    from safetensors.torch import load_file, save_file

    _copy(r, "finished/adapter", "peft-adapter")
    tensors = load_file(r / "peft-adapter" / "adapter_model.safetensors")
    save_file(tensors, r / "peft-adapter" / "adapter_model.safetensors", metadata={"format": "pt"})


def _qlora_run(r: Path) -> None:
    """The finished run as if trained with --quantize nf4 (its config.yaml says so)."""
    _copy(r, "finished", "qlora")
    config = r / "qlora" / "config.yaml"
    config.write_text(config.read_text().replace("quantize: none", "quantize: nf4"))


def _half_rank(tensors: dict) -> None:
    name = sorted(k for k in tensors if ".lora_B." in k)[0]
    tensors[name] = tensors[name][:, : tensors[name].shape[1] // 2].clone()


def _cut_gguf(r: Path) -> None:
    if not (r / "gguf" / "whole.gguf").exists():
        (r / "gguf").mkdir(exist_ok=True)
        _run(["export", "--model", str(r / "model"), "--out", str(r / "gguf" / "whole.gguf")])
    data = (r / "gguf" / "whole.gguf").read_bytes()
    (r / "gguf" / "cut.gguf").write_bytes(data[: len(data) * 2 // 3])


_TASK = ("task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
         "output_type: multiple_choice\ndoc_to_text: \"{{{{q}}}}\"\ndoc_to_choice: \"{{{{c}}}}\"\n"
         "doc_to_target: 0\n")


def _task_folder(name: str, text: str) -> Callable[[Path], None]:
    def setup(r: Path) -> None:
        (r / f"tasks-{name}").mkdir(exist_ok=True)
        (r / f"tasks-{name}" / f"{name}.yaml").write_text(text.replace("{r}", str(r)))
    return setup


def _data(name: str, text: str) -> Callable[[Path], None]:
    return lambda r: (r / name).write_text(text)


def _gz(r: Path) -> None:
    import gzip

    (r / "train.jsonl.gz").write_bytes(gzip.compress((r / "train.jsonl").read_bytes()))


def _jsonl_folder(r: Path) -> None:
    (r / "jsonl-folder").mkdir(exist_ok=True)
    lines = (r / "train.jsonl").read_text().splitlines(keepends=True)
    (r / "jsonl-folder" / "part-a.jsonl").write_text("".join(lines[:4]))
    (r / "jsonl-folder" / "part-b.jsonl").write_text("".join(lines[4:]))


def _no_eos_no_template(model: Path) -> None:
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": None}))
    (model / "chat_template.jinja").unlink(missing_ok=True)


_CHAT = '{"messages": [{"role": "user", "content": "hi %d"}, {"role": "assistant", "content": "hello"}]}\n'
_PAIRS = ('{"prompt": [{"role": "user", "content": "q%d"}], "chosen": [{"role": "assistant", "content": "a"}], '
          '"rejected": [{"role": "assistant", "content": "b"}]}\n')
_IMPLICIT = ('{"chosen": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], '
             '"rejected": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "b"}]}\n')
_NO_USER = ('{"prompt": [{"role": "system", "content": "s%d"}], "chosen": [{"role": "assistant", "content": "a"}], '
            '"rejected": [{"role": "assistant", "content": "b"}]}\n')


def _modelfile_has(folder: str, *needles: str) -> Callable[[Path], str | None]:
    def check(r: Path) -> str | None:
        text = (r / folder / "m.Modelfile").read_text() if (r / folder / "m.Modelfile").is_file() else ""
        missing = [n for n in needles if n not in text]
        return f"the Modelfile lacks {missing}" if missing else None
    return check


def _smollm2_template(model: Path) -> None:
    (model / "chat_template.jinja").write_text(SMOLLM2_CHAT_TEMPLATE)


CASES += [
    # --- provenance: an adapter meets only its own base ----------------------------------------------
    *[Case(f"{command} an adapter of another base (same shapes)", _meets(command, "other"),
           words="was trained on another base model", setup=_other_base, keep=lambda r: r / "finished",
           check=lambda r, c=command: _only(r / _base_folder(c), []))
      for command in ("merge", "export", "generate", "eval", "--init-adapter")],
    Case("merge with its base under another path", _meets("merge", "model-copy", into="w-samebase"), code=0,
         words="as its base, not --model", setup=_copy_model("model-copy")),
    Case("merge an adapter that records no base (peft's)", _meets("merge", "model", "peft-adapter", "w-peft"),
         code=0, words="does not record the base model", setup=_unrecorded_adapter),
    Case("eval --adapter of a QLoRA run without --quantize", _meets("eval", "model", "qlora/adapter", "w-qlora"),
         code=0, words="--quantize auto: the fine-tune that wrote", setup=_qlora_run),
    # --- causes named --------------------------------------------------------------------------------
    Case(".jsonl.gz data", lambda r: ["eval", "--model", str(r / "model"), "--data", str(r / "train.jsonl.gz"),
                                      "--max-new-tokens", "0"], code=0, setup=_gz),
    Case("a folder of .jsonl files as --data", lambda r: ["eval", "--model", str(r / "model"), "--data",
                                                          str(r / "jsonl-folder"), "--max-new-tokens", "0"],
         code=0, setup=_jsonl_folder),
    Case("a lone surrogate in JSON data", ft(data="surrogate.jsonl"), words="surrogate.jsonl:1: 'instruction' holds "
         "a lone surrogate", setup=_data("surrogate.jsonl", '{"instruction": "a\\ud800", "output": "b"}\n' * 4)),
    Case("import-gguf of a GGUF cut short", lambda r: ["import-gguf", str(r / "gguf" / "cut.gguf"),
                                                       str(r / "w-imported")],
         words="is cut short: its header places tensor", setup=_cut_gguf, check=lambda r: _absent(r / "w-imported")),
    Case("merge an adapter whose lora_A and lora_B ranks differ", _with_adapter("merge", "rank-adapter"),
         words="lora_A has rank 8", setup=_adapter_variant("rank-adapter", _half_rank),
         check=_nothing_written("merge", "rank-adapter")),
    Case("eval --tasks with a malformed local task file", lambda r: [
        "eval", "--model", str(r / "model"), "--tasks", "broken", "--include-path", str(r / "tasks-broken")],
         words="broken.yaml:2 is not valid YAML", setup=_task_folder("broken", "task: broken\n  x: [\n")),
    Case("eval --tasks with a missing local data_files path", lambda r: [
        "eval", "--model", str(r / "model"), "--tasks", "gone", "--include-path", str(r / "tasks-gone")],
         words="absent.jsonl does not exist",
         setup=_task_folder("gone", _TASK.format(name="gone", data="{r}/absent.jsonl"))),
    Case("adapter-from-checkpoint RUN (a run folder)", lambda r: ["adapter-from-checkpoint", str(r / "ckpt"),
                                                                  str(r / "w-fromrun")],
         words="is a run folder, not a checkpoint: give one of its checkpoints (step-1)",
         check=lambda r: _absent(r / "w-fromrun")),
    Case("export --out in a missing folder", lambda r: ["export", "--model", str(r / "model"), "--out",
                                                        str(r / "no-such-folder" / "m.gguf")],
         words="cannot be created: its folder", check=lambda r: _absent(r / "no-such-folder")),
    Case("export with a non-UTF-8 chat_template.jinja", lambda r: [
        "export", "--model", str(r / "badjinja"), "--out", str(r / "w-badjinja.gguf")],
         words="chat_template.jinja:1: not valid UTF-8", check=lambda r: _absent(r / "w-badjinja.gguf"),
         setup=_copy_model("badjinja", lambda m: (m / "chat_template.jinja").write_bytes(b"\xff{{ x }}"))),
    Case("finetune with a non-UTF-8 chat_template.jinja", ft(model="badjinja", out="w-badjinja-run"),
         words="chat_template.jinja:1: not valid UTF-8", check=lambda r: _absent(r / "w-badjinja-run"),
         setup=_copy_model("badjinja", lambda m: (m / "chat_template.jinja").write_bytes(b"\xff{{ x }}"))),
    Case("export --check vllm --max-lora-rank 0", lambda r: [
        "export", "--adapter", str(r / "finished" / "adapter"), "--check", "vllm", "--max-lora-rank", "0"],
         words="vLLM accepts only 1, 8, 16"),
    # --- silent quality traps and inconsistencies ----------------------------------------------------
    Case("--dpo-beta under --objective sft", ft("--dpo-beta", "0.5", out="w-dpobeta"),
         words="option 'dpo-beta' applies to --objective dpo only"),
    Case('"input": null in JSONL', lambda r: ["eval", "--model", str(r / "model"), "--data", str(r / "null.jsonl"),
                                              "--max-new-tokens", "0"], code=0,
         setup=_data("null.jsonl", '{"instruction": "a", "input": null, "output": "b"}\n' * 4)),
    Case("a JSON key given twice", ft(data="twice.jsonl", out="w-twice"), words="twice.jsonl:1: key 'output' is "
         "given twice", setup=_data("twice.jsonl", '{"instruction": "a", "output": "b", "output": "c"}\n' * 4)),
    Case("chat data, a tokenizer without chat template or EOS", ft("--strategy", "single", model="plain-tok",
                                                                   data="chat.jsonl", out="w-plain-tok"),
         code=0, words="has no chat template", setup=lambda r: (_copy_model("plain-tok", _no_eos_no_template)(r),
                                                                _data("chat.jsonl", "".join(_CHAT % i for i in
                                                                                            range(8)))(r))),
    Case("a tokenizer without EOS", ft("--strategy", "single", model="plain-tok", out="w-no-eos"), code=0,
         words="has no EOS token", setup=_copy_model("plain-tok", _no_eos_no_template)),
    Case("generate a prompt longer than the context", lambda r: [
        "generate", "--model", str(r / "model"), "--prompt", "x" * 300], words="no room is left for an answer"),
    Case("DPO pairs mixing explicit and implicit prompts", ft("--objective", "dpo", "--strategy", "single",
                                                              data="mixed.jsonl", out="w-mixed"),
         code=0, words="pairs give a 'prompt' and 1 do not",
         setup=_data("mixed.jsonl", "".join(_PAIRS % i for i in range(7)) + _IMPLICIT)),
    Case("DPO pairs without a user turn", ft("--objective", "dpo", "--strategy", "single", data="nouser.jsonl",
                                             out="w-nouser"),
         code=0, words="conversations have no user turn",
         setup=_data("nouser.jsonl", "".join(_NO_USER % i for i in range(8)))),
    Case("export of the demo model's chat template (SmolLM2)", lambda r: [
        "export", "--model", str(r / "smollm2"), "--out", str(r / "w-smollm2" / "m.gguf")], code=0,
         setup=lambda r: (_copy_model("smollm2", _smollm2_template)(r), (r / "w-smollm2").mkdir(exist_ok=True)),
         check=_modelfile_has("w-smollm2", "TEMPLATE", 'SYSTEM """You are a helpful AI assistant named SmolLM')),
    # --- long sequences and context parallelism (each case its own --out: a refused run must leave it absent) ---
    *[Case(f"--context-parallel {value} on 2 ranks", ft("--nproc", "2", f"--context-parallel={value}",
                                                        out=f"w-cp-{value}"),
           words=words, check=lambda r, value=value: _absent(r / f"w-cp-{value}"))
      for value, words in [("3", "option 'context-parallel'"), ("0", "option 'context-parallel'"),
                           ("-2", "option 'context-parallel'"), ("abc", "argument --context-parallel")]],
    *[Case(f"--context-parallel 2 {name}", ft("--context-parallel", "2", *extra, out=f"w-cp-{name}"),
           words="option 'context-parallel'", check=lambda r, name=name: _absent(r / f"w-cp-{name}"))
      for name, extra in [("ddp", ("--nproc", "2", "--strategy", "ddp")),
                          ("fsdp1", ("--nproc", "2", "--strategy", "fsdp1")),
                          ("single", ("--strategy", "single")), ("nproc-1", ("--nproc", "1"))]],
    Case("--context-parallel 2 with --objective grpo",
         lambda r: [*grpo("constant", "--nproc", "2", "--strategy", "fsdp2", "--context-parallel", "2")(r)],
         words="option 'context-parallel'", setup=_grpo_files, check=lambda r: _absent(r / "grpo")),
    Case("--context-parallel 2 on a GPT-2 (learned positions)",
         ft("--nproc", "2", "--context-parallel", "2", model="gpt2", out="w-cp-gpt2"), code=0,
         setup=lambda r: (r / "gpt2").exists() or make_model(r / "gpt2", "gpt2")),
    *[Case(f"--context-parallel 2 {' '.join(extra)}", ft("--nproc", "2", "--context-parallel", "2", *extra,
                                                         out=f"w-cp-{extra[-1].strip('-')}"), code=0)
      for extra in [("--seq-len", "63"), ("--packing",), ("--quantize", "nf4")]],
    *[Case(f"--{flag} {value}", ft(f"--{flag}={value}", out=f"w-{flag}{value}"), words=words,
           check=lambda r, flag=flag, value=value: _absent(r / f"w-{flag}{value}")) for flag, value, words in [
        ("mlp-tile", "0", "option 'mlp-tile'"), ("mlp-tile", "-1", "option 'mlp-tile'"),
        ("mlp-tile", "64", "cuts nothing"), ("mlp-tile", "1000000000", "cuts nothing"),
        ("mlp-tile", "x", "argument --mlp-tile"), ("loss-chunk", "0", "option 'loss-chunk'"),
        ("loss-chunk", "-3", "option 'loss-chunk'")]],
    Case("--mlp-tile 32 over --context-parallel 2 (a rank sees 32 tokens)",
         ft("--nproc", "2", "--context-parallel", "2", "--mlp-tile", "32", out="w-cp-tile"),
         words="cuts nothing", check=lambda r: _absent(r / "w-cp-tile")),
    Case("--fsdp-unit part with --mlp-tile", ft("--nproc", "2", "--strategy", "fsdp2", "--fsdp-unit", "part",
                                                "--mlp-tile", "4", "--activation-checkpointing", out="w-part-tile"),
         words="option 'mlp-tile'", check=lambda r: _absent(r / "w-part-tile")),
    # offloading saved tensors goes with any strategy, checkpointed or not; on CPU a no-op it says is one
    Case("--activation-offload without checkpointing", ft("--activation-offload", "--no-activation-checkpointing",
                                                          out="w-offload-nockpt"), code=0),
    Case("--activation-offload under ddp", ft("--activation-offload", "--strategy", "ddp", "--nproc", "2",
                                              out="w-offload-ddp"), code=0),
    # --seq-len caps a row: short records in rows of up to 10^7 tokens are rows of their own length
    Case("--seq-len 10^7 over short records", ft("--seq-len", "10000000", out="w-seq-huge"), code=0),
    Case("--seq-len 1", ft("--seq-len", "1", out="w-seq-1"), words="no record has a target token within --seq-len 1",
         check=lambda r: _absent(r / "w-seq-1")),
    Case("plan --context-parallel 3 on 2 ranks", lambda r: [
        "plan", "--model", str(r / "model"), "--nproc", "2", "--seq-len", "64", "--context-parallel", "3"],
         words="option 'context-parallel'"),
    # plan answers "nothing fits" on stdout: an answer, not a fault
    Case("plan --seq-len 10^9", lambda r: ["plan", "--model", str(r / "model"), "--nproc", "2", "--seq-len",
                                           "1000000000"], code=0),
    Case("plan --mlp-tile 0", lambda r: ["plan", "--model", str(r / "model"), "--nproc", "2", "--mlp-tile", "0"],
         words="option 'mlp-tile'"),
]


def _zeroed_checkpoint(r: Path) -> None:
    import shutil

    shutil.copytree(r / "ckpt" / "checkpoints", r / "zeroed", dirs_exist_ok=True)
    for data in (r / "zeroed" / "step-1").glob("*.distcp"):
        data.write_bytes(b"\0" * data.stat().st_size)


def _without_model_record(r: Path) -> None:
    """The ckpt run's checkpoint as an older shardtune wrote it: no base model fingerprint."""
    import shutil

    shutil.rmtree(r / "oldckpt", ignore_errors=True)
    shutil.copytree(r / "ckpt", r / "oldckpt")
    meta_file = r / "oldckpt" / "checkpoints" / "step-1" / "checkpoint.json"
    meta = json.loads(meta_file.read_text())
    meta.pop("model", None)
    meta_file.write_text(json.dumps(meta))


def prepare(r: Path) -> None:
    make_model(r / "model", "llama")
    write_jsonl(r / "train.jsonl", instruction_records(8))
    base = [sys.executable, "-m", "shardtune", "finetune", "--model", str(r / "model"), "--data",
            str(r / "train.jsonl"), "--steps", "1", "--batch-size", "4", "--seq-len", "64", "--dtype", "fp32",
            "--strategy", "single"]
    for out, extra in (("finished", []), ("ckpt", ["--save-every", "1"])):
        subprocess.run([*base, "--out", str(r / out), *extra], check=True, capture_output=True)


def _stopped_mid_write(argv: list[str], env: dict, timeout: float) -> subprocess.Popen:
    """``python -m shardtune ARGV``, stopped by itself (SIGSTOP) inside its write: output locked, temporary made."""
    proc = subprocess.Popen([sys.executable, "-m", "shardtune", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**env, "SHARDTUNE_TEST_FAIL_AT": "stop@write"})
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if Path(f"/proc/{proc.pid}/stat").read_text().rpartition(")")[2].split()[0] == "T":
            return proc
        time.sleep(0.1)
    raise TimeoutError(f"{argv[0]} never reached its write")


def _finish(proc: subprocess.Popen, signum: int, timeout: float) -> tuple[int, str]:
    """Send ``signum`` to a process stopped mid-write and let it go on: (its exit code, its stderr)."""
    proc.send_signal(signum)
    proc.send_signal(signal.SIGCONT)
    _, err = proc.communicate(timeout=timeout)
    return proc.returncode, err


def judge(case: Case, r: Path, timeout: float = TIMEOUT) -> dict:
    if case.setup:
        try:
            case.setup(r)
        except Exception as err:  # an earlier case destroyed what this one needs (a model a GGUF overwrote, say)
            return {"case": case.name, "exit": None, "verdict": f"bad: its setup failed ({type(err).__name__})",
                    "seconds": 0.0, "message": str(err)[:300]}
    kept = case.keep(r) if case.keep else None
    before = _snapshot(kept) if kept else None
    env = {**os.environ, **{k: v.replace("{r}", str(r)) for k, v in case.env.items()}}
    started = time.monotonic()
    holder, holder_code, holder_err = None, None, ""
    try:
        if case.holder:
            holder = _stopped_mid_write(case.holder(r), env, timeout)
        if case.signal:
            code, err = _finish(_stopped_mid_write(case.args(r), env, timeout), case.signal, timeout)
        else:
            done = subprocess.run([sys.executable, "-m", "shardtune", *case.args(r)], capture_output=True, text=True,
                                  timeout=timeout, env=env)
            code, err = done.returncode, done.stderr
        if holder is not None:
            holder_code, holder_err = _finish(holder, signal.SIGTERM, timeout)
    except (subprocess.TimeoutExpired, TimeoutError):
        return {"case": case.name, "exit": None, "verdict": "bad: hang", "seconds": timeout, "message": ""}
    message = next((line for line in err.splitlines() if line.startswith("error:")), err.strip()[-200:])
    problem = case.check(r) if case.check else None
    if "Traceback" in err + holder_err:
        verdict = "bad: traceback"
    elif code == 0 and case.code != 0:
        verdict = "bad: silent success"
    elif kept and _snapshot(kept) != before:
        verdict = "bad: something lost"
    elif code != case.code:
        verdict = f"bad: exit {code}, expected {case.code}"
    elif holder is not None and holder_code != 128 + signal.SIGTERM:
        verdict = f"bad: the first writer ended with {holder_code} on SIGTERM"
    elif problem:
        verdict = f"bad: {problem}"
    elif case.words not in err:
        verdict = "weak: message misses " + repr(case.words)
    else:
        verdict = "good"
    return {"case": case.name, "exit": code, "verdict": verdict,
            "seconds": round(time.monotonic() - started, 1), "message": message[:300]}


RESULT = ROOT / "bench" / "results" / "hostile-sweep.json"
VERDICTS = ("good", "weak", "bad")


def _write(rows: list[dict], parts: list[str] | None = None) -> dict[str, int]:
    """Write the result after every case: a sweep cut off (a machine's time limit) keeps what it judged.
    Cases judged before, by an earlier run or part (``--only``), stay unless judged again; ``parts``:
    the commands of the parts merged in (default: this one)."""
    old = json.loads(RESULT.read_text()) if RESULT.is_file() else {}
    names = {case.name for case in CASES}
    judged = {row["case"]: row for row in old.get("cases", []) if row["case"] in names}
    judged |= {row["case"]: row for row in rows}
    merged = [judged[case.name] for case in CASES if case.name in judged]  # in the sweep's order
    summary = {v: sum(1 for row in merged if row["verdict"].startswith(v)) for v in VERDICTS}
    record = run_record()
    commands = list(dict.fromkeys([*old.get("parts", []), *(parts or [record["command"]])]))
    if len(commands) > 1:
        record["command"] = "python bench/hostile_sweep.py"
        record["note"] = f"run in {len(commands)} parts (--only), merged (--merge); each part's command is in 'parts'"
    tmp = RESULT.with_suffix(".tmp")
    tmp.write_text(json.dumps({"cases": merged, "summary": summary, "total": len(CASES), "parts": commands,
                               **record}, indent=1) + "\n")
    os.replace(tmp, RESULT)
    return summary


def merge(files: list[Path]) -> int:
    """Merge the verdicts of parts run elsewhere (their result files) into RESULT; a later file wins."""
    for file in files:
        data = json.loads(file.read_text())
        summary = _write(data["cases"], data.get("parts") or [data.get("command", str(file))])
    print(f"{RESULT} now holds {sum(summary.values())} of {len(CASES)} cases: {summary}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", default=[],
                        help="run only the cases whose name contains this (repeatable: any of them); the other "
                             "cases' earlier verdicts in the result file are kept")
    parser.add_argument("--list", action="store_true", help="print the case names and exit")
    parser.add_argument("--timeout", type=float, default=TIMEOUT, help=f"seconds before a case is a hang [{TIMEOUT}]")
    parser.add_argument("--merge", nargs="+", type=Path, metavar="FILE",
                        help="merge these result files (parts run in other checkouts) into the result and exit")
    args = parser.parse_args()
    if args.list:
        print("\n".join(case.name for case in CASES))
        return 0
    if args.merge:
        return merge(args.merge)
    env_path = os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])
    os.environ["PYTHONPATH"] = env_path
    os.environ.setdefault("SHARDTUNE_DEVICE", "cpu")
    chosen = [case for case in CASES if not args.only or any(o in case.name for o in args.only)]
    if not args.only:
        RESULT.unlink(missing_ok=True)  # a whole sweep replaces every verdict
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="hostile-") as tmp:
        r = Path(tmp)
        os.environ["SHARDTUNE_CACHE"] = str(r / "cache")
        prepare(r)
        for case in chosen:
            rows.append(judge(case, r, args.timeout))
            row = rows[-1]
            print(f"| {row['case']} | {row['exit']} | {row['verdict']} |", flush=True)
            summary = _write(rows)
    for sleeper in SLEEPERS:
        sleeper.kill()
    ran = {v: sum(1 for row in rows if row["verdict"].startswith(v)) for v in VERDICTS}
    print(f"\n{len(rows)} cases run: {ran}; {RESULT} now holds {sum(summary.values())} of {len(CASES)}: {summary}")
    return 0 if ran["bad"] == 0 else 1

if __name__ == "__main__":
    sys.exit(main())
