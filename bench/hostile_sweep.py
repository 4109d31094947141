"""A hostile new user's sweep: bad options, paths, configs, models and run folders through `python -m shardtune`.

Each case runs the real command in a fresh process (timeout: a hang is a verdict, not a wait) and is
judged: good (the expected exit code, the expected words in the message, no traceback, and the
protected files unchanged), weak (right code, the message misses the words), bad (a traceback, a
hang, a silent success, or something lost). Prints a table and writes bench/results/hostile-sweep.json
after every case (scripts/gen_benchmarks.py renders it in docs/benchmarks.md).

    nice -n 19 python bench/hostile_sweep.py [--only SUBSTRING ...] [--list] [--merge FILE ...]

``--only`` runs a part and merges its verdicts into the file, so a long sweep can run in parts (also
in several checkouts at once, whose files ``--merge`` then brings together).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "bench")]

import torch  # noqa: E402

from record import run_record  # noqa: E402

from tiny import instruction_records, make_model, write_jsonl  # noqa: E402

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
    Case("--val-data a plain directory", ft("--val-data", "{r}/emptydir"), words="is a directory",
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
         code=0, words="--lr 1e+06 is far too large"),
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


def judge(case: Case, r: Path, timeout: float = TIMEOUT) -> dict:
    if case.setup:
        case.setup(r)
    kept = case.keep(r) if case.keep else None
    before = _snapshot(kept) if kept else None
    env = {**os.environ, **{k: v.replace("{r}", str(r)) for k, v in case.env.items()}}
    started = time.monotonic()
    try:
        done = subprocess.run([sys.executable, "-m", "shardtune", *case.args(r)], capture_output=True, text=True,
                              timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"case": case.name, "exit": None, "verdict": "bad: hang", "seconds": timeout, "message": ""}
    err = done.stderr
    message = next((line for line in err.splitlines() if line.startswith("error:")), err.strip()[-200:])
    if "Traceback" in err:
        verdict = "bad: traceback"
    elif done.returncode == 0 and case.code != 0:
        verdict = "bad: silent success"
    elif kept and _snapshot(kept) != before:
        verdict = "bad: something lost"
    elif done.returncode != case.code:
        verdict = f"bad: exit {done.returncode}, expected {case.code}"
    elif case.words not in err:
        verdict = "weak: message misses " + repr(case.words)
    else:
        verdict = "good"
    return {"case": case.name, "exit": done.returncode, "verdict": verdict,
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
    ran = {v: sum(1 for row in rows if row["verdict"].startswith(v)) for v in VERDICTS}
    print(f"\n{len(rows)} cases run: {ran}; {RESULT} now holds {sum(summary.values())} of {len(CASES)}: {summary}")
    return 0 if ran["bad"] == 0 else 1

if __name__ == "__main__":
    sys.exit(main())
