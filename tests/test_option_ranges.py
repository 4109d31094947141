"""Every numeric option's range is declared in the schema (config/options.py) and checked there, through the CLI.

A value out of range ends with exit code 2 and one message naming the option, before any worker
starts and before any optimizer, tokenizer or torch constructor sees it. The meta-test fails when
an option declares no range, so removing one fails the suite.
"""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardtune.cli import main
from shardtune.config import FLAGS, Range, field_type

pytestmark = pytest.mark.usefixtures("no_workers")

NUMERIC = {flag: f for flag, (_, f) in FLAGS.items() if field_type(f) in (int, float)}


def test_every_numeric_option_declares_its_range():
    missing = [flag for flag, f in NUMERIC.items() if not isinstance(f.metadata.get("range"), Range)]
    assert not missing, f"numeric options without a declared range: {missing}"
    assert len(NUMERIC) >= 20  # the schema's numeric options are all here, not filtered away


def _outside(flag: str) -> st.SearchStrategy:
    """Values just and far outside ``flag``'s range, of the option's own type (the ends included when open)."""
    f = NUMERIC[flag]
    allowed: Range = f.metadata["range"]
    integer = field_type(f) is int
    sides = []
    if allowed.low is not None:
        sides.append(st.integers(-10**12, math.ceil(allowed.low)) if integer else st.floats(-1e12, allowed.low))
    if allowed.high is not None:
        sides.append(st.integers(math.floor(allowed.high), 10**15) if integer else st.floats(allowed.high, 1e15))
    return st.one_of(sides).filter(lambda v: v not in allowed)


cases = st.sampled_from(sorted(NUMERIC)).flatmap(lambda flag: st.tuples(st.just(flag), _outside(flag)))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(cases)
def test_out_of_range_values_are_refused_naming_the_option(capsys, tmp_path, case):
    flag, value = case
    out = tmp_path / "out"
    code = main(["finetune", "--model", "m", "--data", "d.jsonl", "--out", str(out), f"--{flag}={value!r}"])
    err = capsys.readouterr().err
    assert code == 2, (flag, value, err)
    assert f"option '{flag}'" in err, (flag, value, err)
    assert "Traceback" not in err and not out.exists()


@pytest.mark.parametrize("flag, value, expected", [
    ("weight-decay", "-1", "must be at least 0"),
    ("max-grad-norm", "-1", "must be at least 0"),
    ("warmup-steps", "-5", "must be at least 0"),
    ("min-lr-ratio", "5", "must be in [0, 1]"),
    ("save-every", "-1", "must be at least 0"),
    ("eval-every", "-1", "must be at least 0"),
    ("lora-alpha", "0", "must be greater than 0"),
    ("lora-dropout", "1", "must be in [0, 1)"),
    ("nproc", "0", "must be at least 1"),
    ("collective-timeout", "0", "must be in (0, 604800]"),
])
def test_the_issue_values_are_refused_through_python_m_shardtune(tmp_path, flag, value, expected):
    """The named examples, through the command a user types."""
    if flag != "weight-decay":  # one real process is enough: the others run in-process, same code
        code = main(["finetune", "--model", "m", "--data", "d.jsonl", "--out", str(tmp_path / "o"), f"--{flag}", value])
        assert code == 2
        return
    done = subprocess.run([sys.executable, "-m", "shardtune", "finetune", "--model", "m", "--data", "d.jsonl",
                           "--out", str(tmp_path / "o"), f"--{flag}", value], capture_output=True, text=True)
    assert done.returncode == 2 and f"option '{flag}' {expected}" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("flag, value", [("weight-decay", "-1"), ("min-lr-ratio", "5"), ("lora-alpha", "0"),
                                         ("lora-dropout", "1")])
def test_the_message_says_the_range(capsys, tmp_path, flag, value):
    main(["finetune", "--model", "m", "--data", "d.jsonl", "--out", str(tmp_path / "o"), f"--{flag}", value])
    err = capsys.readouterr().err
    assert f"option '{flag}' must be " in err and f"got {float(value)}" in err


def test_single_strategy_with_several_processes_is_refused_up_front(capsys, tmp_path):
    code = main(["finetune", "--model", "m", "--data", "d.jsonl", "--out", str(tmp_path / "o"),
                 "--strategy", "single", "--nproc", "2"])
    err = capsys.readouterr().err
    assert code == 2 and "option 'strategy': single runs one process" in err and "2 ranks" in err


def test_more_cpu_workers_than_cores_warns(caplog, tmp_path, tiny_llama, train_jsonl, monkeypatch):
    import os

    import shardtune.launch

    # the checks' verdict is all this needs
    monkeypatch.setattr(shardtune.launch, "launch", lambda cfg, plan, asked=None: {})
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    code = main(["finetune", "--model", str(tiny_llama), "--data", str(train_jsonl), "--out", str(tmp_path / "o"),
                 "--device", "cpu", "--nproc", "4", "--batch-size", "4", "--steps", "1"])
    assert code == 0
    assert "option 'nproc': 4 CPU workers on 2 usable core(s)" in caplog.text


def test_duplicated_yaml_key_is_refused_naming_key_and_line(capsys, tmp_path):
    config = tmp_path / "job.yaml"
    config.write_text("model: m\nlora-r: 4\nsteps: 3\nlora-r: 16\n")
    code = main(["finetune", "--config", str(config)])
    err = capsys.readouterr().err
    assert code == 2 and f"{config}:4: option 'lora-r' is given twice (first on line 2)" in err, err


def test_duplicated_key_in_a_section_and_across_spellings(capsys, tmp_path):
    config = tmp_path / "job.yaml"
    config.write_text("lora:\n  r: 4\n  r: 8\n")
    assert main(["finetune", "--config", str(config)]) == 2
    assert f"{config}:3: option 'r' is given twice" in capsys.readouterr().err
    config.write_text("lora_r: 4\nlora-r: 8\n")
    assert main(["finetune", "--config", str(config)]) == 2
    assert "option 'lora-r' is given twice" in capsys.readouterr().err


def test_wandb_without_a_login_is_refused_before_training(capsys, tmp_path, monkeypatch, tiny_llama, train_jsonl):
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    code = main(["finetune", "--model", str(tiny_llama), "--data", str(train_jsonl), "--out", str(tmp_path / "o"),
                 "--report-to", "wandb"])
    err = capsys.readouterr().err
    assert code == 2 and "option 'report-to': wandb has no login" in err and "WANDB_MODE=offline" in err, err
