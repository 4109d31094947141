"""One run plan: `shardtune plan` refuses exactly what `shardtune finetune` refuses, and accepts with the
same plan; the workers run the plan they are handed."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

import shardtune.launch
from shardtune import cli
from shardtune.config import build_config
from shardtune.runplan import RunPlan
from shardtune.train.resolve import resolve

from tiny import instruction_records, make_model, write_jsonl

# Each row exercises at least one rule: a strategy that cannot take an option (config.combination_refusal),
# the batch arithmetic with and without packing, nf4's even split over ranks, and the automatic choice.
STRATEGIES = ("auto", "fsdp2", "fsdp1", "ddp", "single")
EXTRAS = ([], ["--quantize", "nf4"], ["--lora-variant", "dora"], ["--cpu-offload"], ["--packing"],
          ["--replicate-groups", "2"])
BATCHES = (["--batch-size", "6"], ["--batch-size", "8", "--micro-batch-size", "3"])
GRID = [(n, s, e, b) for n, s, e, b in itertools.product((1, 2, 3), STRATEGIES, EXTRAS, BATCHES)
        # a sample that keeps every strategy × option pair, and every rank count with each option
        if (n + STRATEGIES.index(s) + EXTRAS.index(e)) % 3 == 0 or (n == 2 and b is BATCHES[1])]


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("runplan")
    make_model(root / "model", "llama", hidden=64)  # rows of 64 input features: nf4 quantizes them
    write_jsonl(root / "train.jsonl", instruction_records(12))
    return root


def _verdict(code: int, err: str, plan: dict | None) -> tuple:
    if code:
        return code, err.strip().splitlines()[-1]
    # every decision compared; the reason's wording (its predicted peak in MiB) is left out
    return code, {k: v for k, v in plan.items() if k != "why"}


def finetune_verdict(root: Path, flags: list[str], capsys, monkeypatch) -> tuple:
    launched: list[RunPlan] = []
    monkeypatch.setattr(shardtune.launch, "launch", lambda cfg, plan, asked=None: launched.append(plan) or {})
    code = cli.main(["finetune", *flags, "--data", str(root / "train.jsonl"), "--out", str(root / "out")])
    err = capsys.readouterr().err
    return _verdict(code, err, launched[0].as_dict() if launched else None)


def plan_verdict(root: Path, flags: list[str], capsys) -> tuple:
    code = cli.main(["plan", *flags, "--data", str(root / "train.jsonl"), "--json"])
    captured = capsys.readouterr()
    return _verdict(code, captured.err, json.loads(captured.out)["run_plan"] if code == 0 else None)


def test_plan_refuses_exactly_what_finetune_refuses(root, capsys, monkeypatch):
    verdicts = {}
    for nproc, strategy, extra, batch in GRID:
        flags = ["--model", str(root / "model"), "--nproc", str(nproc), "--strategy", strategy, "--seq-len", "64",
                 "--lora-r", "4", "--memory-per-rank", "64GiB", *extra, *batch]
        finetune, planned = finetune_verdict(root, flags, capsys, monkeypatch), plan_verdict(root, flags, capsys)
        assert finetune == planned, " ".join(flags)
        verdicts[" ".join(flags)] = finetune[0]
    refused = [f for f, code in verdicts.items() if code == 2]
    # the grid reaches both sides of the rules: refusals and runs, each several times
    assert 10 < len(refused) < len(verdicts) - 10, refused
    assert all(code in (0, 2) for code in verdicts.values())


def test_packing_counts_rows_so_a_micro_batch_need_not_divide_the_batch(root, capsys, monkeypatch):
    """The disagreement that was: plan refused what finetune trained. Under --packing the micro-batch
    counts packed rows (the packing rule won); without packing the split must be exact."""
    flags = ["--model", str(root / "model"), "--nproc", "2", "--batch-size", "8", "--micro-batch-size", "3",
             "--seq-len", "64", "--memory-per-rank", "64GiB"]
    for command in (lambda f: finetune_verdict(root, f, capsys, monkeypatch), lambda f: plan_verdict(root, f, capsys)):
        code, packed = command([*flags, "--packing"])
        assert code == 0 and packed["batch"] == {"batch_size": 8, "micro_batch_size": 3, "world_size": 2,
                                                 "packing": True}
        code, message = command(flags)
        assert code == 2 and "cannot be made of micro-batches of 3 on 2 ranks" in message


def test_a_worker_refuses_a_plan_that_is_not_its_own(root):
    """Workers assert the plan they receive; they do not decide again."""
    cfg, plan, _ = resolve(build_config({"model": str(root / "model"), "nproc": 2, "strategy": "fsdp2",
                                         "batch-size": 4, "fsdp-unit": "layer", "dtype": "fp32"}))
    plan.check(cfg, 2, "cpu")
    with pytest.raises(RuntimeError, match="world_size|batch"):
        plan.check(cfg, 4, "cpu")
    other = build_config({"model": str(root / "model"), "nproc": 2, "strategy": "ddp", "batch-size": 4,
                          "dtype": "fp32"})
    with pytest.raises(RuntimeError, match="strategy"):
        plan.check(other, 2, "cpu")
    assert RunPlan.from_dict(json.loads(json.dumps(plan.as_dict()))) == plan  # what the launcher hands on


def test_python_m_shardtune_train_resolves_on_rank_0(root, tmp_path):
    """Started by hand without a plan file, rank 0 resolves the plan (auto options included)."""
    import subprocess
    import sys

    import yaml

    cfg = {"model": str(root / "model"), "data": str(root / "train.jsonl"), "out": str(tmp_path / "o"),
           "steps": 1, "batch-size": 2, "seq-len": 64, "lora-r": 4, "strategy": "auto", "micro-batch-size": "auto",
           "dtype": "fp32", "memory-per-rank": "64GiB"}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    (tmp_path / "o").mkdir()  # the launcher makes it; started by hand, the caller does
    done = subprocess.run([sys.executable, "-m", "shardtune.train", str(tmp_path / "c.yaml")], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert summary["run_plan"]["strategy"] == "single" and summary["run_plan"]["batch"]["micro_batch_size"] == 2
