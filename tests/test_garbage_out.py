"""Rule: a detected fault never ends in exit 0 with a result someone could ship.

An adapter of no tensors or of NaN is refused by every command that reads one (one check, in
model/directory.py); merge and export never write a non-finite value; a run whose update blew the
weights up ends non-zero keeping only the checkpoints from before; preference data that cannot
teach anything, --eval-every without validation data and --resume of a finished run are refused.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from shardtune.cli import main
from test_merge import _random_adapter

from tiny import make_model, write_jsonl


@pytest.fixture(scope="module")
def bad_adapters(tmp_path_factory) -> dict[str, Path]:
    """A base model and adapters for it: a good one, one of no tensors, one with NaN in a lora_B, and one
    whose values are finite but blow the merged weights past fp32 (or, merged, past f16)."""
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("garbage")
    make_model(root / "base", "llama")
    _random_adapter(root / "base", root / "good", {})
    tensors = load_file(root / "good" / "adapter_model.safetensors")
    b = next(k for k in tensors if "layers.1.self_attn.v_proj.lora_B" in k)

    def variant(name: str, change) -> None:
        shutil.copytree(root / "good", root / name)
        changed = {k: v.clone() for k, v in tensors.items()}
        change(changed)
        save_file(changed, root / name / "adapter_model.safetensors", metadata={"format": "pt"})

    variant("empty", lambda t: t.clear())
    variant("nan", lambda t: t[b].view(-1).__setitem__(0, math.nan))
    variant("huge", lambda t: t.update({k: v * 1e30 for k, v in t.items() if "v_proj" in k}))
    variant("f16-overflow", lambda t: t.update({b: t[b] * 1e6}))
    return {"base": root / "base", "b": b, **{n: root / n for n in ("good", "empty", "nan", "huge", "f16-overflow")}}


@pytest.mark.parametrize("which,words", [("empty", "holds no tensors"), ("nan", "non-finite value")])
def test_every_command_refuses_an_adapter_of_no_tensors_or_nan(bad_adapters, tmp_path, capsys, no_workers,
                                                               which, words):
    base, adapter = bad_adapters["base"], bad_adapters[which]
    write_jsonl(tmp_path / "data.jsonl", [{"instruction": "a", "output": "b"}] * 4)
    commands = {
        "merge": ["merge", "--model", str(base), "--adapter", str(adapter), "--out", str(tmp_path / "merged")],
        "export": ["export", "--model", str(base), "--adapter", str(adapter), "--out", str(tmp_path / "m.gguf")],
        "vllm check": ["export", "--adapter", str(adapter), "--check", "vllm"],
        "generate": ["generate", "--model", str(base), "--adapter", str(adapter), "--prompt", "hi"],
        "eval": ["eval", "--model", str(base), "--adapter", str(adapter), "--data", str(tmp_path / "data.jsonl")],
        "--init-adapter": ["finetune", "--model", str(base), "--data", str(tmp_path / "data.jsonl"), "--out",
                           str(tmp_path / "run"), "--init-adapter", str(adapter), "--lora-targets", "all-linear",
                           "--lora-r", "4", "--lora-alpha", "8"],
    }
    for name, argv in commands.items():
        assert main(argv) == 2, name
        err = capsys.readouterr().err
        assert words in err and "adapter_model.safetensors" in err and "Traceback" not in err, (name, err)
        if which == "nan":
            assert bad_adapters["b"] in err, (name, err)  # the tensor is named
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.jsonl"]  # nothing written, no temporary left


def test_merge_and_export_never_write_a_non_finite_value(bad_adapters, tmp_path, capsys):
    base = bad_adapters["base"]
    # finite adapter values whose update overflows fp32 once added to the weight
    assert main(["merge", "--model", str(base), "--adapter", str(bad_adapters["huge"]), "--out",
                 str(tmp_path / "merged")]) == 2
    err = capsys.readouterr().err
    assert "v_proj.weight" in err and "not finite once the adapter's update is added" in err, err
    # finite in fp32, but past f16's range: a GGUF in f16 would hold inf
    out = tmp_path / "m.gguf"
    assert main(["export", "--model", str(base), "--adapter", str(bad_adapters["f16-overflow"]), "--out", str(out),
                 "--quant", "f16"]) == 2
    err = capsys.readouterr().err
    assert "layers.1.self_attn.v_proj.weight" in err and "in float16" in err and "--quant bf16" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    assert main(["export", "--model", str(base), "--adapter", str(bad_adapters["f16-overflow"]), "--out", str(out),
                 "--quant", "bf16"]) == 0


def test_an_update_that_blew_the_weights_up_ends_the_run_keeping_the_checkpoints_before(trained_run, tmp_path):
    """A zero gradient right after a step that had one: that step's update blew the weights up. The guard
    stops the run (Diverged: exit 2), deletes the checkpoints written from those weights, names the newest
    good one and how to resume; the recipe then writes no adapter (as for a non-finite loss)."""
    from shardtune.train.guard import Diverged, TrainingGuard

    out = tmp_path / "run"
    shutil.copytree(trained_run, out)
    guard = TrainingGuard(out, 1e6, True)
    guard.check(1, 5.0, 0.5)
    guard.check(2, 5.0, 0.4)
    with pytest.raises(Diverged) as stopped:
        guard.check(3, 5.0, 0.0)  # the update of step 2 did it: step-2 and step-3 hold its weights
    message = str(stopped.value)
    assert message.startswith("training diverged at step 3: the gradient norm is exactly 0"), message
    assert "the update of step 2 blew the LoRA weights up" in message and "--lr 1e+06 is far too large" in message
    assert "step-2, step-3, written from the blown-up weights, were deleted" in message
    assert f"the newest complete checkpoint, {out / 'checkpoints' / 'step-1'}, is kept" in message
    assert f"shardtune finetune --config {out / 'config.yaml'} --resume --lr" in message
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-1"]


def test_preference_pairs_that_are_all_identical_are_refused(run_root, tmp_path, capsys, no_workers):
    pairs = [{"prompt": f"q{i}", "chosen": "same", "rejected": "same"} for i in range(8)]
    write_jsonl(tmp_path / "pairs.jsonl", pairs)
    assert main(["finetune", "--model", str(run_root / "model"), "--data", str(tmp_path / "pairs.jsonl"), "--out",
                 str(tmp_path / "run"), "--objective", "dpo", "--steps", "1", "--batch-size", "4"]) == 2
    err = capsys.readouterr().err
    assert "in all 8 pairs the chosen and the rejected response are the same" in err, err
    assert not (tmp_path / "run").exists()


def test_eval_every_without_validation_data_is_refused(run_root, tmp_path, capsys, no_workers):
    assert main(["finetune", "--model", str(run_root / "model"), "--data", str(run_root / "train.jsonl"), "--out",
                 str(tmp_path / "run"), "--eval-every", "2"]) == 2
    assert "option 'eval-every' (2) validates on --val-data, which is not given" in capsys.readouterr().err


def test_resume_of_a_finished_run_is_refused_and_changes_nothing(trained_run, tmp_path, capsys, no_workers):
    out = tmp_path / "run"
    shutil.copytree(trained_run, out)
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert main(["finetune", "--config", str(out / "config.yaml"), "--out", str(out), "--resume"]) == 2
    err = capsys.readouterr().err
    assert f"the run in {out} has finished all its 3 steps" in err and "larger --steps" in err, err
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    assert json.loads((out / "summary.json").read_text())["steps"] == 3


def test_the_adapter_check_passes_a_good_adapter(bad_adapters):
    from shardtune.model.adapter_dir import check_adapter_dir

    assert check_adapter_dir(bad_adapters["good"])["r"] == 4
