"""bench/gpu_check.sh cannot rot between the rare GPU machines: it parses, its options work, every row's
command is one the CLI takes, and its verdicts (bench/gpu_check.py) pass and fail what they should."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from shardtune import cli

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "gpu_check.sh"
sys.path.insert(0, str(ROOT / "bench"))

import gpu_check  # noqa: E402


def _sh(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, **(env or {})})


def test_script_parses_lists_its_rows_and_refuses_unknown_ones():
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0
    quick, full = _sh("--list", "--quick").stdout.split(), _sh("--list").stdout.split()
    assert set(quick) < set(full) and {"nf4", "fp16", "dtype-auto", "dpo-precomputed", "eval", "generate",
                                       "torchrun"} <= set(quick)
    assert {"plan-fsdp2", "plan-fsdp1", "plan-ddp", "plan-single", "offload", "ac", "auto-limit", "varlen",
            "harness", "orpo-dora", "simpo-packed", "eval-nf4"} <= set(full)
    bad = _sh("--only", "no-such-row")
    assert bad.returncode == 2 and "no row no-such-row" in bad.stderr
    assert _sh("--frobnicate").returncode == 2


def test_the_overall_limit_ends_the_check_and_keeps_a_failed_row_for_it(tmp_path):
    """A check cut off by its --limit (a hung collective, a slow machine) exits 124 saying so, and its
    summary holds the rows judged so far plus the limit as a failed row (it used to write none)."""
    done = _sh("--cpu-smoke", "--only", "env", "--limit", "1", env={"CACHE": str(tmp_path)})
    assert done.returncode == 124, done.stdout[-2000:] + done.stderr[-2000:]
    assert "FAIL gpu_check: the whole check ran past its 1 s limit" in done.stdout
    rows = json.loads((tmp_path / "gpu_check-cpu-smoke.json").read_text())
    assert {k: rows[-1][k] for k in ("row", "passed", "problems")} == {
        "row": "gpu_check", "passed": False, "problems": ["ran past its 1 s limit"]}
    assert rows[-1]["commit"] and rows[-1]["date"]  # when the verdict was measured


def test_every_rows_shardtune_command_is_one_the_cli_takes(tmp_path):
    done = _sh("--dry-run", env={"CACHE": str(tmp_path), "PYTHONPATH": str(ROOT / "src")})
    assert done.returncode == 0, done.stderr[-2000:]
    commands = [shlex.split(line.split(" > ", 1)[0]) for line in done.stdout.splitlines() if "-m shardtune " in line]
    rows = [line.split()[1].rstrip(":") for line in done.stdout.splitlines() if line.startswith("row ")]
    assert rows == _sh("--list").stdout.split()  # every row, in order
    assert len(commands) >= 25
    for argv in commands:
        args = argv[argv.index("shardtune") + 1:]
        if args[0] in ("finetune", "plan"):
            assert args[args.index("--collective-timeout") + 1] == "60", argv  # a hung collective: 60 s
        cli.build_parser().parse_args(args)  # exits (fails the test) on a flag the CLI does not have


def _summary(**changes) -> dict:
    s = {"strategy": "fsdp2", "world_size": 1, "dtype": "bf16", "backend": "nccl", "device": "cuda",
         "micro_batch_size": 8, "activation_checkpointing": False, "train_loss_first": 2.0, "train_loss_last": 1.5,
         "tokens_per_second": 1000.0, "load_seconds": 3.0, "val_loss": None, "runtime_mb": [1100.0],
         "train_peak_mb": [9000.0], "cuda_max_allocated_mb": {"train": [9000.0]},
         "cuda_max_reserved_mb": {"train": [10000.0]}, "run_plan": {"cpu_offload": False, "quantize": "none"}}
    return {**s, **changes}


def _plan(peak: float, runtime: float = 1524.0) -> dict:
    row = {"peak_mb": peak, "activation_checkpointing": False, "cpu_offload": False, "terms": {"runtime": runtime}}
    return {"fsdp2": {**row, "variants": []}}


@pytest.mark.parametrize("planned,passes", [(11100.0, True), (11100.0 * 1.3, False), (11100.0 * 0.7, False)])
def test_planner_row_compares_the_whole_peak_with_reserved_plus_outside_torch(tmp_path, monkeypatch, capsys,
                                                                              planned, passes):
    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps(_summary()))
    (tmp_path / "plan.json").write_text(json.dumps(_plan(planned)))
    monkeypatch.setenv("GPU_CHECK_RESULTS", str(tmp_path / "results.jsonl"))
    code = gpu_check.main(["check", "plan-fsdp2", "--out", str(run), "--plan", str(tmp_path / "plan.json")])
    out = capsys.readouterr().out
    assert (code == 0) == passes, out
    assert "measured_mb 11100" in out  # 10000 reserved + 1100 outside torch
    assert json.loads((tmp_path / "results.jsonl").read_text())["passed"] == passes


def test_a_run_off_the_gpu_or_without_nccl_or_scaling_fields_fails(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps(_summary(device="cpu", backend="gloo", dtype="fp16")))
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n")
    assert gpu_check.main(["check", "fp16", "--out", str(run), "--expect", "dtype=fp16",
                           "--metric", "skipped_steps"]) == 1
    out = capsys.readouterr().out
    assert "ran on cpu, not cuda" in out and "backend gloo, not NCCL" in out and "no skipped_steps" in out
    assert gpu_check.main(["collect", str(tmp_path / "none.jsonl"), str(tmp_path / "out.json")]) == 1  # no rows


@pytest.mark.parametrize("grad_norm, passes", [(1.005, True), (1.3, False)])
def test_a_run_that_must_compute_what_another_did_fails_on_another_gradient(tmp_path, monkeypatch, capsys,
                                                                           grad_norm, passes):
    """long-offload against long-context: within bf16's noise it passes; a gradient off by 30% at one step
    (a wrong tensor in backward) fails, naming the step."""
    runs = {}
    for name, norm in (("long-context", 1.0), ("long-offload", grad_norm)):
        runs[name] = tmp_path / name
        runs[name].mkdir()
        (runs[name] / "summary.json").write_text(json.dumps(_summary()))
        steps = [{"step": 1, "loss": 2.0, "grad_norm": 1.0}, {"step": 2, "loss": 1.9, "grad_norm": norm}]
        (runs[name] / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in steps))
    monkeypatch.setenv("GPU_CHECK_RESULTS", str(tmp_path / "results.jsonl"))
    code = gpu_check.main(["check", "long-offload", "--out", str(runs["long-offload"]),
                           "--same-as", str(runs["long-context"])])
    out = capsys.readouterr().out
    assert (code == 0) == passes, out
    assert ("step 2: grad_norm 1.3 against 1" in out) == (not passes), out
    assert gpu_check.main(["check", "long-offload", "--out", str(runs["long-offload"]),
                           "--same-as", str(tmp_path / "never-ran")]) == 1
    assert "the run to compare with has no metrics.jsonl" in capsys.readouterr().out


def _dry_rows(out: str) -> list[str]:
    return [line.split()[1].rstrip(":") for line in out.splitlines() if line.startswith("row ")]


def test_pending_runs_only_the_rows_not_passed_failed_and_not_run_first(tmp_path):
    """--pending reads the results file: the rows recorded as failed or not run, in their usual order,
    then the rows it does not hold; a row whose adapter another uses comes along when it is not here."""
    full = _sh("--list").stdout.split()
    verdicts = {"dtype-auto": False, "eval": None, "plan-ddp": False, "tests": None, "varlen": True}
    recorded = [{"row": r, "passed": verdicts.get(r, True)} for r in full if r != "grpo"]
    recorded[full.index("varlen")]["skipped"] = "flash_attn is not installed here"  # a skip is a pass
    summary = tmp_path / "gpu_check.json"
    summary.write_text(json.dumps(recorded))
    env = {"CACHE": str(tmp_path / "cache"), "GPU_CHECK_SUMMARY": str(summary), "PYTHONPATH": str(ROOT / "src")}
    assert _sh("--list", "--pending", env=env).stdout.split() == ["dtype-auto", "eval", "plan-ddp", "tests", "grpo"]
    done = _sh("--dry-run", "--pending", env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    # eval uses sft-val's adapter, which a fresh machine does not have: sft-val runs before it
    assert _dry_rows(done.stdout) == ["dtype-auto", "sft-val", "eval", "plan-ddp", "tests", "grpo"]
    assert _sh("--list", "--pending", "--only", "fp16,eval", env=env).stdout.split() == ["eval"]
    assert json.loads(summary.read_text()) == recorded  # a dry run writes nothing

    summary.write_text(json.dumps([{"row": r, "passed": True} for r in full]))
    done = _sh("--pending", env=env)
    assert done.returncode == 0 and "nothing pending" in done.stdout
    summary.write_text("{not json")
    bad = _sh("--pending", env=env)
    assert bad.returncode == 2 and str(summary) in bad.stderr


def test_collect_merge_replaces_the_rows_run_again_and_keeps_the_others(tmp_path, monkeypatch, capsys):
    old = [{"row": "a", "passed": True, "commit": "0ld0ld0", "date": "2026-12-01"},
           {"row": "b", "passed": False, "problems": ["broke"]},
           {"row": "c", "passed": None, "problems": ["not run: budget"]},
           {"row": "d", "passed": False, "problems": ["broke too"]},
           {"row": "gpu_check", "passed": False, "problems": ["ran past its 480 s limit"]}]
    out = tmp_path / "gpu_check.json"
    out.write_text(json.dumps(old))
    new = [{"row": "e", "passed": None, "problems": ["not run: budget"]},
           {"row": "b", "passed": True, "problems": []},
           {"row": "c", "passed": False, "problems": ["broke now"]},
           {"row": "d", "passed": None, "problems": ["not run: budget"]}]
    results = tmp_path / "results.jsonl"
    results.write_text("".join(json.dumps(r) + "\n" for r in new))
    monkeypatch.setenv("GPU_CHECK_COMMIT", "abc1234")
    code = gpu_check.main(["collect", str(results), str(out), "--merge", "--order", "a,b,c,d,e"])
    assert code == 1  # c failed
    merged = {r["row"]: r for r in json.loads(out.read_text())}
    assert list(merged) == ["a", "b", "c", "d", "e"]  # the old gpu_check row was about its own run
    assert merged["a"] == old[0]  # not run again: its verdict, commit and date stay
    assert merged["b"]["passed"] is True and merged["b"]["commit"] == "abc1234" and merged["b"]["date"]
    assert merged["c"]["problems"] == ["broke now"]
    assert merged["d"] == old[3]  # not run for the budget: its last verdict says more
    assert merged["e"]["passed"] is None and merged["e"]["commit"] == "abc1234"
    assert "still pending: c, d, e" in capsys.readouterr().out
    assert gpu_check.pending(list(merged.values()), ["a", "b", "c", "d", "e", "f"]) == ["c", "d", "e", "f"]


def test_a_row_that_would_pass_the_limit_is_not_run_and_recorded_so(tmp_path):
    """Before a row starts, the time spent plus its estimated cost must fit --limit; a row that does not is
    a `passed: null` row, "not run: budget", and later cheaper rows still run (the dry run adds the
    estimates up in place of the clock)."""
    text = SCRIPT.read_text()
    tiny, big = (int(re.search(rf"^{name}=(\d+)$", text, re.M).group(1)) for name in ("ROW_S_TINY", "ROW_S_BIG"))
    cache = tmp_path / "cache"
    done = _sh("--dry-run", "--only", "fp16,plan-fsdp2,grpo", "--limit", str(tiny + big - 1),
               env={"CACHE": str(cache), "PYTHONPATH": str(ROOT / "src")})
    assert done.returncode == 0, done.stderr[-2000:]
    sections: dict[str, list[str]] = {}
    for line in done.stdout.splitlines():
        if line.startswith("row "):
            sections[line.split()[1].rstrip(":")] = []
        elif sections:
            sections[list(sections)[-1]].append(line)
    assert list(sections) == ["fp16", "plan-fsdp2", "grpo"]
    assert sections["plan-fsdp2"] == [f"NOT RUN plan-fsdp2: budget (~{big} s needed, {big - 1} s left of the "
                                      f"{tiny + big - 1} s limit)"]  # no command of it
    assert any("-m shardtune finetune" in line for line in sections["grpo"])  # a cheaper row after it runs
    summary = tmp_path / "gpu_check.json"
    assert gpu_check.main(["collect", str(cache / "results.jsonl"), str(summary), "--merge"]) == 1  # none judged
    rows = json.loads(summary.read_text())
    assert [(r["row"], r["passed"]) for r in rows] == [("plan-fsdp2", None)]
    assert rows[0]["problems"][0].startswith("not run: budget")
