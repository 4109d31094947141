"""--strategy/--micro-batch-size/--fsdp-unit auto: the fastest setting the planner says fits, decided once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from shardtune import cli
from shardtune.config import ConfigError, build_config
from shardtune.train.choice import candidates, choose
from shardtune.train.data.records import Lengths
from shardtune.train.resolve import resolve

from tiny import make_run_dir

MB = 1024 * 1024


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return make_run_dir(tmp_path_factory.mktemp("choice"), tied=False, records=16)


def _options(root: Path, **extra) -> dict:
    return {"model": str(root / "model"), "data": str(root / "train.jsonl"), "out": str(root / "out"), "nproc": 2,
            "batch-size": 8, "seq-len": 64, "strategy": "auto", "micro-batch-size": "auto", **extra}


def _cfg(root: Path, **extra):
    return build_config(_options(root, **extra))


def test_roomy_budget_takes_ddp_with_the_largest_micro_batch(root):
    cfg, best, why = choose(_cfg(root, **{"memory-per-rank": "1TiB"}))
    # ddp gathers no weights; 4 records per rank in one forward; no recomputation
    assert (best.strategy, best.micro_batch_size, best.activation_checkpointing) == ("ddp", 4, False)
    chosen = (cfg.parallel.strategy, cfg.train.micro_batch_size, cfg.parallel.activation_checkpointing)
    assert chosen == ("ddp", 4, False)
    assert "fewest weight collectives" in why
    assert "chosen" not in cfg.flat()  # the reason is output (the run plan's), not an option


def test_choice_is_the_first_fitting_setting_by_the_speed_rule(root):
    found = candidates(_cfg(root), 1 << 40)
    fsdp2 = [c for c, _ in found if c.strategy == "fsdp2"]
    layer = min((c for c in fsdp2 if c.fsdp_unit == "layer"), key=lambda c: c.peak_mb)
    part = min((c for c in fsdp2 if c.fsdp_unit == "part"), key=lambda c: c.peak_mb)
    assert layer.collectives < part.collectives  # whole layers: one gather per layer instead of one per part
    peaks = sorted({c.peak_mb for c, _ in found})
    for budget_mb in (peaks[0], peaks[len(peaks) // 2], peaks[-1]):  # only the smallest; about half; all
        fitting = [c for c, _ in found if c.peak_mb <= budget_mb]
        cfg, best, _ = choose(_cfg(root, **{"memory-per-rank": f"{budget_mb + 0.001:.3f}MiB"}))
        assert best in fitting and best.key() == min(c.key() for c in fitting)
        assert best.peak_mb <= budget_mb + 0.001


def test_nothing_fits_names_the_budget_and_the_smallest_peak(root):
    with pytest.raises(ConfigError, match=r"memory-per-rank.*no setting fits 1 MiB per rank; the smallest "
                                          r"predicted peak is [0-9.]+ [KMG]iB \("):
        resolve(_cfg(root, **{"memory-per-rank": "1MiB"}))


def test_explicit_settings_are_kept(root):
    cfg, best, why = choose(_cfg(root, strategy="fsdp1", **{"micro-batch-size": 2, "fsdp-unit": "part"}))
    assert best is None and why == "" and cfg.parallel.strategy == "fsdp1" and cfg.train.micro_batch_size == 2


def test_plan_shows_the_choice_and_finetune_runs_it_on_every_rank(root, capsys):
    assert cli.main(["plan", "--model", str(root / "model"), "--nproc", "2", "--batch-size", "8", "--seq-len", "64",
                     "--micro-batch-size", "auto", "--memory-per-rank", "1TiB"]) == 0
    out = capsys.readouterr().out
    assert "finetune would run: fastest setting that fits" in out and "ddp, micro-batch 4" in out

    import shardtune

    summary = shardtune.finetune(_options(root, steps=1, **{"memory-per-rank": "1TiB", "strategy": "fsdp2"}))
    assert summary["strategy"] == "fsdp2" and summary["fsdp_unit"] == "layer" and summary["micro_batch_size"] == 4
    assert "fastest setting that fits" in summary["strategy_reason"]
    # config.yaml keeps what was asked (auto), so that it decides again on other ranks; the run plan
    # in summary.json holds what auto chose, and why
    written = yaml.safe_load((root / "out" / "config.yaml").read_text())
    assert written["micro-batch-size"] == "auto" and written["fsdp-unit"] == "auto" and "chosen" not in written
    saved = json.loads((root / "out" / "summary.json").read_text())
    assert saved["micro_batch_size"] == 4 and saved["run_plan"]["batch"]["micro_batch_size"] == 4
    assert saved["run_plan"]["fsdp_unit"] == "layer" and "fastest setting that fits" in saved["run_plan"]["why"]


def test_packing_counts_packed_rows_not_records(root):
    """Under --packing the forwards per step come from the rows the records fill, not the record count:
    8 short records a rank fill one 512-token row, so one row per forward is already one forward."""
    cfg = _cfg(root, packing=True, **{"seq-len": 512, "batch-size": 16, "memory-per-rank": "1TiB"})
    _, by_records, _ = choose(cfg)  # lengths unknown (no data read): a row per record
    assert by_records.forwards == 1 and by_records.micro_batch_size == 8
    _, by_rows, _ = choose(cfg, Lengths(40.0, 60))  # 8 x 40 tokens: one row
    assert by_rows.forwards == 1 and by_rows.micro_batch_size == 1  # no room reserved for 7 empty rows
    assert by_rows.peak_mb < by_records.peak_mb
    _, two_rows, _ = choose(cfg, Lengths(100.0, 150))  # 800 tokens: two rows
    assert (two_rows.micro_batch_size, two_rows.forwards) == (2, 1)
    found = candidates(cfg, 1 << 40, Lengths(100.0, 150))
    assert max(c.micro_batch_size for c, _ in found) == 2
    assert {c.forwards for c, _ in found if c.micro_batch_size == 1} == {2}


def test_shardtune_device_cpu_on_a_gpu_host_plans_cpu_ranks(root, monkeypatch):
    """One device decision: on a GPU host with SHARDTUNE_DEVICE=cpu the ranks run on the CPU, so the
    choice sizes them by the RAM with CPU terms, as the run plan says (the planner used to ignore
    SHARDTUNE_DEVICE there and size CPU ranks with a GPU's memory and CUDA terms)."""
    import torch

    from shardtune.train.choice import strategy_rows
    from shardtune.train.memory_model import CUDA_CONTEXT_MB
    from shardtune.train.resolve import resolve

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU host, as torch sees it
    monkeypatch.setenv("SHARDTUNE_DEVICE", "cpu")
    cfg, run, best = resolve(_cfg(root))
    assert (run.device, run.backend) == ("cpu", "gloo")
    assert best is not None and "available RAM / 2 local ranks" in run.why
    rows = strategy_rows(cfg, 1 << 40, run)
    assert all(p.terms["runtime"] != CUDA_CONTEXT_MB for preds in rows.values() for p in preds if p.terms)


def test_plan_with_an_auto_option_computes_the_model_facts_once(root, monkeypatch, capsys):
    """The choice and `plan`'s table read one search: the meta model is built once, and each micro-batch
    size is traced once (they used to enumerate candidates each, building both again)."""
    from shardtune.model import footprint

    built, traced = [], []
    real_build, real_saved = footprint.build_meta_model, footprint._saved_bytes
    monkeypatch.setattr(footprint, "_TRACES", {})  # none made by an earlier test in this process
    monkeypatch.setattr(footprint, "build_meta_model", lambda *a, **k: built.append(1) or real_build(*a, **k))
    monkeypatch.setattr(footprint, "_saved_bytes",
                        lambda model, batch, seq, dtype, device: traced.append((batch, dtype))
                        or real_saved(model, batch, seq, dtype, device))
    assert cli.main(["plan", "--model", str(root / "model"), "--nproc", "2", "--batch-size", "8", "--seq-len", "64",
                     "--strategy", "auto", "--micro-batch-size", "auto", "--memory-per-rank", "1TiB", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["run_plan"]["strategy"] == "ddp" and doc["ddp"]["runs"]
    assert len(built) == 1
    assert len(traced) == len(set(traced)) == 3  # micro-batches 1, 2 and 4 records, each traced once


def test_a_default_micro_batch_that_does_not_fit_gives_way_to_a_smaller_one(root):
    """--micro-batch-size left out (every row of a rank in one forward) where that does not fit the budget: the
    run takes fewer rows per forward, keeps the global batch and says why; given, the micro-batch stays and the
    refusal names the one that fits."""
    import shardtune

    options = {k: v for k, v in _options(root, strategy="fsdp2").items() if k != "micro-batch-size"}
    four = min(c.peak_mb for c, _ in candidates(build_config(options), 1 << 40))  # the default: 8 / 2 ranks
    one = min(c.peak_mb for c, _ in candidates(build_config({**options, "micro-batch-size": 1}), 1 << 40))
    assert one < four
    budget = f"{one + 0.05:.3f}MiB"
    summary = shardtune.finetune({**options, "steps": 1, "memory-per-rank": budget, "out": str(root / "shrunk")})
    assert summary["strategy"] == "fsdp2" and summary["micro_batch_size"] < 4
    assert "the default micro-batch" in summary["strategy_reason"]
    with pytest.raises(ConfigError, match=r"It fits with --micro-batch-size 1\b"):
        resolve(build_config({**options, "micro-batch-size": 4, "memory-per-rank": budget}))


def test_a_sequence_too_long_for_every_rank_names_context_parallelism(root, capsys):
    """A --seq-len that no micro-batch fits on one rank, under ddp: the refusal names the flags that cut each
    sequence over the ranks, which `plan` then runs."""
    # bf16 given: --dtype auto is fp32 on CPUs without native bf16, where not even 2 ranks' split fits 4GiB
    argv = ["plan", "--model", str(root / "model"), "--nproc", "2", "--seq-len", "5000000", "--memory-per-rank",
            "4GiB", "--micro-batch-size", "1", "--dtype", "bf16"]
    assert cli.main([*argv, "--strategy", "ddp"]) == 2
    err = capsys.readouterr().err
    fix = err.split("It fits with ")[1].split(".")[0]
    assert fix.startswith("--strategy fsdp2 --context-parallel 2 --micro-batch-size 1"), err
    assert cli.main([*argv, *fix.replace("--micro-batch-size 1", "").split()]) == 0
    chosen = [line for line in capsys.readouterr().out.splitlines() if line.startswith("* ")]
    fields = chosen[0].split()  # * strategy AC offload peak fits
    assert fields[1] == "fsdp2" and fields[2] == "yes" and fields[5] == "yes", chosen


def test_mlp_tiles_go_with_whole_layer_units(root, capsys):
    """FSDP2's per-part units with MLP tiles (whose backward failed on a micro-batch of one row): refused when
    given, naming the option, before anything is written; never paired by the choice."""
    out = root / "parts"
    assert cli.main(["finetune", "--model", str(root / "model"), "--data", str(root / "train.jsonl"), "--out",
                     str(out), "--nproc", "2", "--strategy", "fsdp2", "--fsdp-unit", "part", "--mlp-tile", "32",
                     "--micro-batch-size", "1", "--steps", "1"]) == 2
    assert "option 'mlp-tile' (32) goes with whole-layer units" in capsys.readouterr().err
    assert not out.exists()
    found = [c for c, _ in candidates(_cfg(root, strategy="fsdp2", **{"mlp-tile": "auto"}), 1 << 40)]
    assert any(c.fsdp_unit == "part" for c in found) and any(c.mlp_tile for c in found)
    assert not any(c.fsdp_unit == "part" and c.mlp_tile for c in found)
