"""Long context through the commands a user types: ``plan --seq-len max`` agrees with ``plan`` and with
``finetune``'s refusal of a too-long --seq-len; --mlp-tile auto tiles only when the untiled run does not fit;
--mlp-tile, --loss-chunk and --activation-offload (on CPU) leave the numbers of a run unchanged; bad
values and a --seq-len beyond the model's positions are named.

Budgets are found from the plan itself (what the CPU runtime adds differs between machines): a width's
predicted peaks, tiled and untiled, set a --memory-per-rank between them."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import shardtune.launch
from shardtune.cli import main

from tiny import write_jsonl

MIB = 1 << 20
#: one sequence per forward on one process: what the widths below are planned for
ONE = ["--dtype", "fp32", "--strategy", "single", "--batch-size", "1"]


def _plan(capsys: pytest.CaptureFixture, *args: str) -> dict:
    """``plan ARGS --json``'s object (``capsys``: or ``capfd``)."""
    capsys.readouterr()
    assert main(["plan", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _mib(mib: float) -> str:
    return f"{mib:.4f}MiB"


@pytest.fixture(scope="module")
def long_jsonl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 records of about 7,000 tokens each (the tiny tokenizer has a token per byte)."""
    words = ["red", "blue", "cat", "dog", "sun", "moon", "tree", "sea", "rock", "bird"]
    records = [{"instruction": f"Tell story {i}", "output": " ".join(words[(i + j) % 10] for j in range(1400))}
               for i in range(4)]
    return write_jsonl(tmp_path_factory.mktemp("long") / "long.jsonl", records)


@pytest.fixture
def launched(monkeypatch: pytest.MonkeyPatch) -> list:
    """The (cfg, plan) a fine-tune would have started its workers with; no worker starts."""
    calls: list = []
    monkeypatch.setattr(shardtune.launch, "launch", lambda cfg, plan, asked=None: calls.append((cfg, plan)) or {})
    return calls


@pytest.fixture(scope="module")
def peaks_at_2048(tiny_llama: Path) -> dict[str, float]:
    """Predicted peaks (MiB) of one 2048-token row on the tiny Llama: untiled, tiled (--mlp-tile 32)."""
    import contextlib
    import io

    out = {}
    for name, extra in (("untiled", []), ("tiled", ["--mlp-tile", "32"])):
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            assert main(["plan", "--model", str(tiny_llama), *ONE, "--seq-len", "2048", *extra, "--json"]) == 0
        doc = json.loads(buf.getvalue())
        assert doc["run_plan"]["mlp_tile"] == (32 if extra else 0)
        out[name] = doc["single"]["peak_mb"]
    assert out["tiled"] < out["untiled"], "tiling the MLP must lower the predicted peak of a 2048-token row"
    return out


def test_seq_len_max_agrees_with_plan_at_that_length(tiny_llama, peaks_at_2048, capsys):
    budget = peaks_at_2048["tiled"] + 0.01  # 2048 tokens fit tiled (the JSON rounds to 0.001 MiB), not untiled
    common = ["--model", str(tiny_llama), *ONE, "--memory-per-rank", _mib(budget)]
    doc = _plan(capsys, *common, "--seq-len", "max")
    n = doc["max_seq_len"]["single"]
    assert n == doc["longest"]["single"]["max_seq_len"] and n % 64 == 0
    assert 2048 <= n < 4096
    # as configured, --mlp-tile auto tiles: no flag to add for it; checkpointing goes further
    frugal = doc["longest"]["single"]["with_flags"]
    assert frugal["flags"] == "--activation-checkpointing" and frugal["seq_len"] > n

    fits = _plan(capsys, *common, "--seq-len", str(n))
    assert fits["single"]["peak_mb"] <= budget and fits["single"]["fits"] is True
    assert fits["run_plan"]["mlp_tile"] > 0  # beyond the untiled length: auto tiled it
    # the same setting at n + 64, given explicitly (so nothing is left to choose): predicted over the budget
    over = _plan(capsys, *common, "--seq-len", str(n + 64), "--mlp-tile", str(fits["run_plan"]["mlp_tile"]))
    assert over["single"]["peak_mb"] > budget and over["single"]["fits"] is False
    # left to auto, n + 64 is refused, naming the flag that makes it fit; beyond what that reaches, n
    assert main(["plan", *common, "--seq-len", str(n + 64)]) == 2
    err = capsys.readouterr().err
    assert f"at --seq-len {n + 64}" in err and "It fits with --activation-checkpointing." in err
    assert main(["plan", *common, "--seq-len", str(frugal["seq_len"] + 64)]) == 2
    assert f"The longest --seq-len that fits is {n} as configured, {frugal['seq_len']} with " \
           f"--activation-checkpointing" in capsys.readouterr().err
    # --strategy auto turns checkpointing on by itself when nothing fits without: then it is as configured
    auto = _plan(capsys, *[a for a in common if a not in ("--strategy", "single")], "--seq-len", "max")
    assert auto["longest"]["single"] == {"ranks": 1, "context_parallel": 1, "max_seq_len": frugal["seq_len"],
                                         "with_flags": {"seq_len": frugal["seq_len"], "flags": ""}}


def test_seq_len_max_has_a_row_per_context_parallel_size_given_or_not(tiny_llama, capsys):
    """Each --context-parallel size the ranks allow has its own row, the one given included: the given size's
    row is not replaced by CP 1's, and more pieces of a sequence fit a longer one."""
    common = ["--model", str(tiny_llama), "--dtype", "fp32", "--nproc", "2", "--batch-size", "2",
              "--memory-per-rank", "400MB", "--seq-len", "max"]
    rows = [_plan(capsys, *common, *extra)["longest"] for extra in ([], ["--context-parallel", "2"])]
    for longest in rows:
        assert (longest["fsdp2"]["context_parallel"], longest["fsdp2 cp2"]["context_parallel"]) == (1, 2)
        assert longest["fsdp2 cp2"]["max_seq_len"] > longest["fsdp2"]["max_seq_len"] > 0
    assert rows[0]["fsdp2"] == rows[1]["fsdp2"] and rows[0]["fsdp2 cp2"] == rows[1]["fsdp2 cp2"]


def test_seq_len_max_without_a_known_budget_is_refused(tiny_llama, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: its memory is the budget")
    assert main(["plan", "--model", str(tiny_llama), "--device", "cuda", "--seq-len", "max"]) == 2
    assert "option 'seq-len': max needs --memory-per-rank" in capsys.readouterr().err


def test_finetune_too_long_is_refused_before_loading_naming_the_longest(tiny_llama, long_jsonl, peaks_at_2048,
                                                                        tmp_path, capsys, no_workers):
    budget = _mib(peaks_at_2048["tiled"] + 0.01)
    doc = _plan(capsys, "--model", str(tiny_llama), *ONE, "--memory-per-rank", budget, "--seq-len", "max")
    longest = doc["longest"]["single"]
    assert longest["with_flags"]["seq_len"] < 6144  # so the records' 6144 tokens fit in no way
    out = tmp_path / "out"
    code = main(["finetune", "--model", str(tiny_llama), "--data", str(long_jsonl), "--out", str(out), *ONE,
                 "--seq-len", "6144", "--memory-per-rank", budget, "--steps", "1"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "--seq-len 6144" in err
    assert f"The longest --seq-len that fits is {longest['max_seq_len']} as configured, " \
           f"{longest['with_flags']['seq_len']} with --activation-checkpointing" in err
    assert not out.exists() or not any(out.iterdir()), "a refused run wrote into --out"


@pytest.mark.parametrize("flag", ["mlp-tile", "loss-chunk"])
@pytest.mark.parametrize("value", ["0", "-1", "x", "1.5"])
def test_bad_tile_or_chunk_is_named(tiny_llama, tmp_path, capsys, flag, value):
    argv = ["plan", "--model", str(tiny_llama), *ONE]
    try:
        code = main([*argv, f"--{flag}={value}"])
    except SystemExit as stop:  # argparse: not a number
        code = stop.code
    err = capsys.readouterr().err
    assert code == 2
    assert f"--{flag}" in err or f"option '{flag}'" in err, err

    config = tmp_path / "run.yaml"
    config.write_text(f"{flag}: {value}\n")
    assert main([*argv, "--config", str(config)]) == 2
    assert f"option '{flag}'" in capsys.readouterr().err


@pytest.mark.parametrize("extra, most", [
    ([], 64),
    (["--nproc", "2", "--strategy", "fsdp2", "--context-parallel", "2"], 32),  # a rank sees half of each row
], ids=["one-rank", "cp2"])
def test_a_tile_that_cuts_no_row_is_refused_not_ignored(tiny_llama, train_jsonl, tmp_path, capsys, launched, extra,
                                                        most):
    """A --mlp-tile of at least the tokens a rank's MLP sees of a row would leave every row whole: the run
    says so before it starts, from the command line or a config file; one token fewer tiles."""
    common = ["--model", str(tiny_llama), *ONE, "--seq-len", "64", *extra]
    assert _plan(capsys, *common, "--mlp-tile", str(most - 1))["run_plan"]["mlp_tile"] == most - 1
    config = tmp_path / "run.yaml"
    config.write_text(f"mlp-tile: {most}\n")
    for tile in (["--mlp-tile", str(most)], ["--config", str(config)], ["--mlp-tile", "1000000000"]):
        out = tmp_path / "out"
        assert main(["finetune", *common, *tile, "--data", str(train_jsonl), "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert "option 'mlp-tile'" in err and f"cuts nothing: a rank's MLP sees at most {most} tokens" in err, err
        assert f"use a tile below {most}" in err
        assert not launched and not out.exists()


def test_a_grpo_tile_counts_the_completion(tiny_llama, tmp_path, capsys):
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "2+2=", "answer": "4"}] * 4)
    common = ["--model", str(tiny_llama), *ONE, "--objective", "grpo", "--data", str(prompts), "--reward",
              "exact_match", "--num-generations", "2", "--batch-size", "2", "--seq-len", "64",
              "--max-completion-length", "32"]
    assert _plan(capsys, *common, "--mlp-tile", "95")["run_plan"]["mlp_tile"] == 95  # cuts the 96-token rows
    assert main(["plan", *common, "--mlp-tile", "96"]) == 2
    assert "at most 96 tokens of a row (--seq-len 64 + --max-completion-length 32)" in capsys.readouterr().err


def test_seq_len_beyond_positions_is_warned_unless_rope_scales(tiny_llama, train_jsonl, tmp_path, caplog,
                                                                launched):
    caplog.set_level(logging.WARNING, logger="shardtune")
    argv = ["finetune", "--data", str(train_jsonl), *ONE, "--steps", "1"]
    assert main([*argv, "--seq-len", "300", "--model", str(tiny_llama), "--out", str(tmp_path / "a")]) == 0
    assert len(launched) == 1  # a warning: the run goes on
    assert "--seq-len 300 exceeds the 256 positions" in caplog.text

    scaled = shutil.copytree(tiny_llama, tmp_path / "scaled")
    config = json.loads((scaled / "config.json").read_text())
    config["rope_scaling"] = {"rope_type": "linear", "factor": 2.0}
    (scaled / "config.json").write_text(json.dumps(config))
    caplog.clear()
    assert main([*argv, "--seq-len", "300", "--model", str(scaled), "--out", str(tmp_path / "b")]) == 0
    assert len(launched) == 2 and "positions" not in caplog.text
    caplog.clear()
    assert main([*argv, "--seq-len", "256", "--model", str(tiny_llama), "--out", str(tmp_path / "c")]) == 0
    assert "positions" not in caplog.text


def test_mlp_tile_auto_turns_on_only_where_the_untiled_run_does_not_fit(tiny_llama, long_jsonl, peaks_at_2048,
                                                                        tmp_path, caplog, launched, capsys):
    budget = _mib((peaks_at_2048["tiled"] + peaks_at_2048["untiled"]) / 2)
    caplog.set_level(logging.INFO, logger="shardtune")
    argv = ["finetune", "--model", str(tiny_llama), "--data", str(long_jsonl), *ONE, "--memory-per-rank", budget,
            "--steps", "1"]
    assert main([*argv, "--seq-len", "2048", "--out", str(tmp_path / "tiled")]) == 0
    tile = launched[-1][1].mlp_tile
    assert tile > 0
    assert f"MLP tiled ({tile} tokens per tile, --mlp-tile auto): untiled, the predicted peak exceeds" in caplog.text
    caplog.clear()
    assert main([*argv, "--seq-len", "1024", "--out", str(tmp_path / "untiled")]) == 0
    assert launched[-1][1].mlp_tile == 0 and "MLP tiled" not in caplog.text
    # plan says the same
    plan = ["--model", str(tiny_llama), *ONE, "--memory-per-rank", budget]
    tiled = _plan(capsys, *plan, "--seq-len", "2048")
    assert tiled["run_plan"]["mlp_tile"] == tile and "MLP tiled" in tiled["chosen"]["why"]
    assert tiled["single"]["peak_mb"] == pytest.approx(peaks_at_2048["tiled"], rel=1e-3)  # the row of the tiled run
    assert _plan(capsys, *plan, "--seq-len", "1024")["run_plan"]["mlp_tile"] == 0


def _run(out: Path) -> tuple[list[float], dict[str, torch.Tensor]]:
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    return losses, load_file(out / "adapter" / "adapter_model.safetensors")


def _finetune_like_trained_run(tiny_llama: Path, train_jsonl: Path, out: Path, *flags: str) -> None:
    """The shared ``trained_run``'s fine-tune (conftest.py), with ``flags`` added (a later flag wins)."""
    assert main(["finetune", "--model", str(tiny_llama), "--data", str(train_jsonl), "--out", str(out),
                 "--dtype", "fp32", "--steps", "3", "--batch-size", "4", "--seq-len", "64", "--strategy", "single",
                 "--lr", "1e-3", *flags]) == 0


def _assert_same_run(out: Path, base: Path, loss_atol: float, adapter_rtol: float, adapter_atol: float) -> None:
    """``out``'s losses and adapter are ``base``'s (rtol 1e-5 on the losses)."""
    losses, adapter = _run(out)
    base_losses, base_adapter = _run(base)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(base_losses), rtol=1e-5, atol=loss_atol)
    assert adapter.keys() == base_adapter.keys()
    for key, tensor in base_adapter.items():
        torch.testing.assert_close(adapter[key], tensor, rtol=adapter_rtol, atol=adapter_atol, msg=key)


@pytest.mark.parametrize("flags", [["--mlp-tile", "16"], ["--loss-chunk", "8"], ["--activation-offload"]],
                         ids=["mlp-tile", "loss-chunk", "activation-offload"])
def test_long_context_options_leave_the_run_unchanged(trained_run, tiny_llama, train_jsonl, tmp_path, flags,
                                                      capfd):
    """The options against the shared fine-tune (``trained_run``: untiled, default chunk): same losses, same
    adapter. On CPU --activation-offload says it changes nothing, in finetune (what the user sees: the
    process's stderr) and in plan."""
    out = tmp_path / "run"
    _finetune_like_trained_run(tiny_llama, train_jsonl, out, *flags)
    summary = json.loads((out / "summary.json").read_text())["run_plan"]
    assert (summary["mlp_tile"], summary["loss_chunk"], summary["activation_offload"]) == {
        "--mlp-tile": (16, 0, False), "--loss-chunk": (0, 8, False), "--activation-offload": (0, 0, True)}[flags[0]]
    _assert_same_run(out, trained_run, loss_atol=1e-5, adapter_rtol=1e-5, adapter_atol=1e-5)
    said = capfd.readouterr().err
    assert ("--activation-offload: on CPU it changes nothing" in said) == (flags[0] == "--activation-offload"), said
    if flags[0] == "--activation-offload":
        doc = _plan(capfd, "--model", str(tiny_llama), *ONE, "--seq-len", "64", "--activation-offload")
        assert "on CPU, offloading changes nothing" in doc["single"]["note"]


def test_two_fsdp2_ranks_with_tiles_and_chunks_equal_one_rank(trained_run, tiny_llama, train_jsonl, tmp_path):
    """N ranks = 1 rank with the long-context options on: tiles and chunks under FSDP2's sharded MLPs and
    row-sharded head give the shared single-process run's losses and adapter."""
    out = tmp_path / "run"
    _finetune_like_trained_run(tiny_llama, train_jsonl, out, "--strategy", "fsdp2", "--nproc", "2",
                               "--mlp-tile", "16", "--loss-chunk", "8")
    _assert_same_run(out, trained_run, loss_atol=1e-6, adapter_rtol=1e-4, adapter_atol=1e-6)
