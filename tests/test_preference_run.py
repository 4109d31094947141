"""A preference run as a user starts it: --precompute-reference, validation pairs, resume, --init-adapter checks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from test_preference_ranks import preference_pairs

from tiny import make_model, write_jsonl


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("prefrun")
    make_model(root / "model", "llama")
    write_jsonl(root / "pairs.jsonl", preference_pairs(12))
    write_jsonl(root / "val.jsonl", preference_pairs(5))
    return root


def _options(root: Path, name: str, **extra) -> dict:
    return {"model": str(root / "model"), "data": str(root / "pairs.jsonl"), "val-data": str(root / "val.jsonl"),
            "out": str(root / name), "objective": "dpo", "dtype": "fp32", "steps": 3, "batch-size": 4,
            "lr": 1e-2, "warmup-steps": 1, "seed": 2, **extra}


@pytest.fixture(scope="module")
def live(run_dir) -> dict:
    """The 1-rank run with the live reference: compared with the precomputed one, and its adapter is what the
    --init-adapter checks below start from. Its options."""
    import shardtune

    options = _options(run_dir, "live", strategy="single", nproc=1)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("SHARDTUNE_CACHE", str(run_dir / "cache"))
        shardtune.finetune(options)
    return options


def _metrics(out: str) -> list[dict]:
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def test_precomputed_reference_trains_like_the_live_one_and_is_reused(run_dir, live, monkeypatch):
    import shardtune

    monkeypatch.setenv("SHARDTUNE_CACHE", str(run_dir / "cache"))
    pre = _options(run_dir, "pre", strategy="fsdp2", nproc=2, **{"precompute-reference": True,
                                                                  "micro-batch-size": 1})
    summary = shardtune.finetune(pre)
    a, b = _metrics(live["out"]), _metrics(pre["out"])
    for key in ("loss", "grad_norm", "rewards/margins", "logps/chosen"):
        torch.testing.assert_close(torch.tensor([m[key] for m in b]), torch.tensor([m[key] for m in a]),
                                   rtol=1e-5, atol=1e-6, msg=key)
    # validation pairs: TRL's figures, at the end of the run, also in the summary
    assert {"val_loss", "val_rewards/accuracies", "val_rewards/margins"} <= set(b[-1])
    assert b[-1]["val_loss"] == pytest.approx(a[-1]["val_loss"], rel=1e-5)
    assert summary["val_loss"] == pytest.approx(b[-1]["val_loss"])
    stored = sorted((run_dir / "cache" / "tokenized").glob("ref-*.pt"))
    assert len(stored) == 2  # training and validation pairs
    table = torch.load(stored[0])
    assert table.shape in {(12, 2), (5, 2)} and (table < 0).all()  # log-probs
    # a second run with the same data, model and dtype reads the stored values
    before = {p: p.stat().st_mtime_ns for p in stored}
    again = _options(run_dir, "pre-again", strategy="single", nproc=1, **{"precompute-reference": True})
    shardtune.finetune(again)
    assert {p: p.stat().st_mtime_ns for p in stored} == before
    torch.testing.assert_close(torch.tensor([m["loss"] for m in _metrics(again["out"])]),
                               torch.tensor([m["loss"] for m in a]), rtol=1e-5, atol=1e-6)


def test_resumed_preference_run_continues_exactly(run_dir, monkeypatch):
    import shutil

    import shardtune

    monkeypatch.setenv("SHARDTUNE_CACHE", str(run_dir / "cache2"))
    whole = _options(run_dir, "whole", strategy="single", nproc=1, steps=4, **{"precompute-reference": True})
    shardtune.finetune(whole)
    part = _options(run_dir, "part", strategy="single", nproc=1, steps=4, **{"precompute-reference": True,
                                                                            "save-every": 2})
    shardtune.finetune(part)
    # as if the run had stopped after step 2: only that checkpoint is left, and no summary (a finished run's
    # --resume is refused: it would run nothing)
    shutil.rmtree(Path(part["out"]) / "checkpoints" / "step-4")
    (Path(part["out"]) / "summary.json").unlink()
    resumed = shardtune.finetune({**part, "resume": True})
    assert resumed["resumed_from_step"] == 2
    torch.testing.assert_close(torch.tensor([m["loss"] for m in _metrics(part["out"])]),
                               torch.tensor([m["loss"] for m in _metrics(whole["out"])]), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("change,message", [
    ({"lora-r": 4}, r"adapter_config.json: r is 8 but this run's --lora-r gives 4"),
    ({"lora-targets": "q_proj"}, r"target_modules .* differ from this run's --lora-targets"),
])
def test_init_adapter_that_does_not_fit_is_refused_before_workers(run_dir, live, no_workers, capsys, change, message):
    import re

    from shardtune.cli import main

    trained = Path(live["out"]) / "adapter"
    args = ["finetune", "--model", str(run_dir / "model"), "--data", str(run_dir / "pairs.jsonl"), "--out",
            str(run_dir / "bad"), "--objective", "dpo", "--init-adapter", str(trained), "--lora-targets", "all-linear"]
    for k, v in change.items():
        args += [f"--{k}", str(v)]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert re.search(message, err) and "Traceback" not in err


def test_init_adapter_for_another_base_or_truncated_is_named(run_dir, live, tmp_path, no_workers, capsys):
    from shardtune.cli import main

    other = make_model(tmp_path / "wide", "llama", hidden=64)
    trained = Path(live["out"]) / "adapter"
    base = ["finetune", "--data", str(run_dir / "pairs.jsonl"), "--out", str(tmp_path / "o"), "--objective", "dpo"]
    assert main([*base, "--model", str(other), "--init-adapter", str(trained)]) == 2
    err = capsys.readouterr().err
    assert "was trained on another base model" in err and "hidden_size was 32, now 64" in err, err
    cut = tmp_path / "cut"
    cut.mkdir()
    (cut / "adapter_config.json").write_text((trained / "adapter_config.json").read_text())
    data = (trained / "adapter_model.safetensors").read_bytes()
    (cut / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    assert main([*base, "--model", str(run_dir / "model"), "--init-adapter", str(cut)]) == 2
    err = capsys.readouterr().err
    assert "adapter_model.safetensors" in err and "truncated" in err


def test_eval_on_pairs_reports_preference_accuracy_for_base_and_adapter(run_dir, live, capsys):
    """After DPO the adapter prefers the chosen responses of its training pairs more than the base does."""
    from shardtune.cli import main

    trained = Path(live["out"]) / "adapter"
    args = ["eval", "--model", str(run_dir / "model"), "--data", str(run_dir / "pairs.jsonl"), "--dtype", "fp32"]
    assert main([*args, "--adapter", str(trained), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["pairs"] == 12
    tuned, base = result["adapter_figures"], result["base"]
    assert tuned["mean_margin"] > base["mean_margin"] and tuned["reward_margin"] > 0
    assert tuned["reward_margin"] == pytest.approx(tuned["mean_margin"] - base["mean_margin"], rel=1e-4)
    # saved in the run folder, sent to its trackers at the run's last step, shown by `shardtune report`
    assert json.loads((Path(live["out"]) / "eval.json").read_text()) == result
    assert main([*args, "--adapter", str(trained), "--report-to", "tensorboard"]) == 0
    capsys.readouterr()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "live" / "tensorboard"))
    acc.Reload()
    [event] = acc.Scalars("eval/adapter/pairs/reward_margin")
    assert event.step == 3 and event.value == pytest.approx(tuned["reward_margin"])
    assert acc.Scalars("eval/base/pairs/accuracy")[0].value == pytest.approx(base["accuracy"])
    assert main(["report", str(run_dir / "live")]) == 0
    md = (run_dir / "live" / "report.md").read_text()
    assert "## Preference evaluation on" in md and f"| reward margin | — | {tuned['reward_margin']:.4g} |" in md
    assert main(args) == 0  # the base alone: one column
    out = capsys.readouterr().out
    assert "accuracy: log p(chosen) > log p(rejected)" in out and "+ adapter" not in out
