"""Rule: a run never finishes "successfully" on garbage. A non-finite loss or gradient norm, or a zero gradient
right after an update (it blew the weights up), stops it at that step with a non-zero exit, keeping the last good
checkpoint and writing no adapter; zero gradients from the start are named."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest
import torch

from shardtune.cli import main
from shardtune.train.guard import Diverged, TrainingGuard

from tiny import instruction_records, make_model, write_jsonl


def test_lr_1e30_stops_at_the_first_non_finite_step(tmp_path, capsys):
    from safetensors.torch import load_file

    make_model(tmp_path / "model", "llama")
    write_jsonl(tmp_path / "train.jsonl", instruction_records(8))
    out = tmp_path / "out"
    code = main(["finetune", "--model", str(tmp_path / "model"), "--data", str(tmp_path / "train.jsonl"),
                 "--out", str(out), "--dtype", "fp32", "--steps", "6", "--batch-size", "4", "--seq-len", "64",
                 "--strategy", "single", "--save-every", "1", "--warmup-steps", "0", "--lr", "1e30"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "training diverged at step" in err and "no adapter was written" in err and "Traceback" not in err
    assert not (out / "adapter").exists() and not (out / "summary.json").exists()
    checkpoints = sorted((out / "checkpoints").glob("step-*"))
    assert checkpoints, err  # the steps before the divergence were good and are kept
    assert f"the newest complete checkpoint, {checkpoints[-1]}, is kept" in err
    # ...and hold no NaN: every tensor the checkpoint stores (LoRA weights and optimizer state), read back
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(checkpoints[-1], tmp_path / "ckpt.pt")
    stored = _tensors(torch.load(tmp_path / "ckpt.pt", weights_only=False))
    assert any(".lora_A." in name for name in stored) and any(name.startswith("optim.") for name in stored)
    assert [name for name, t in stored.items() if not torch.isfinite(t).all()] == []
    from shardtune.train.checkpoint_adapter import adapter_from_checkpoint

    adapter = load_file(adapter_from_checkpoint(checkpoints[-1], tmp_path / "a") / "adapter_model.safetensors")
    assert all(torch.isfinite(t).all() for t in adapter.values())


def test_lr_blowing_the_weights_up_is_named_at_the_first_zero_gradient(tmp_path, capsys):
    """bf16 and --lr 1e6: an update saturates the outputs, the loss stays finite and the gradient is exactly 0.
    Either way the run ends non-zero, naming --lr, and writes no adapter from the blown-up weights."""
    import json

    make_model(tmp_path / "model", "llama")
    write_jsonl(tmp_path / "train.jsonl", instruction_records(8))
    out, log = tmp_path / "out", tmp_path / "run.log"
    code = main(["finetune", "--model", str(tmp_path / "model"), "--data", str(tmp_path / "train.jsonl"),
                 "--out", str(out), "--dtype", "bf16", "--steps", "4", "--batch-size", "4", "--seq-len", "64",
                 "--strategy", "single", "--warmup-steps", "0", "--lr", "1e6", "--log-file", str(log)])
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    err = capsys.readouterr().err
    assert code == 2 and not (out / "adapter").exists() and not (out / "summary.json").exists(), err
    if "the gradient norm is nan" in err:
        # Where bf16 matmul is emulated (AVX2-only CPUs) the same update overflows instead: a non-finite
        # gradient, which stops the run, naming --lr as well
        assert "training diverged at step 2: the gradient norm is nan (--lr 1e+06)" in err, err
        assert [m["step"] for m in metrics] == [1]
        return
    zero = [m["step"] for m in metrics if m["grad_norm"] == 0]
    assert zero == [] and len(metrics) >= 1, metrics  # the step with the zero gradient is not logged: it stopped there
    step = len(metrics) + 1
    assert f"training diverged at step {step}: the gradient norm is exactly 0 right after an optimizer step" in err
    assert "--lr 1e+06 is far too large" in err and "start again with a smaller --lr" in err, err


def _tensors(tree, prefix: str = "") -> dict[str, torch.Tensor]:
    """{dotted path: tensor} for every floating tensor in a nested state dict."""
    if isinstance(tree, torch.Tensor):
        return {prefix: tree} if tree.is_floating_point() else {}
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, (list, tuple)) else ()
    return {k: v for key, sub in items for k, v in _tensors(sub, f"{prefix}.{key}" if prefix else str(key)).items()}


@pytest.mark.parametrize("loss,norm,what", [(math.nan, 1.0, "the loss is nan"), (1.0, math.inf, "norm is inf")])
def test_guard_refuses_non_finite_values(tmp_path, loss, norm, what):
    with pytest.raises(Diverged, match=f"training diverged at step 7: .*{what}.*no checkpoint was written"):
        TrainingGuard(tmp_path, 1e-3, True).check(7, loss, norm)


def test_guard_stops_at_the_first_zero_gradient_after_an_update(tmp_path):
    """A zero gradient right after a step that had one: the update blew the weights up; the run stops there."""
    guard = TrainingGuard(Path(tmp_path), 1e6, True)
    guard.check(1, 2.0, 0.5)
    with pytest.raises(Diverged, match=r"training diverged at step 2: the gradient norm is exactly 0 right after an "
                                       r"optimizer step .*the update of step 1 blew the LoRA weights up.*--lr 1e\+06 "
                                       r"is far too large.*no adapter was written; no checkpoint was written before"):
        guard.check(2, 2.0, 0.0)


def test_guard_warns_once_when_the_gradient_is_zero_from_the_start(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="shardtune")
    guard = TrainingGuard(Path(tmp_path), 1e-3, True)
    for step in range(1, 7):
        guard.check(step, 2.0, 0.0)
    assert caplog.text.count("exactly 0 for 3 steps in a row (steps 1-3)") == 1
    assert "right after an optimizer step" not in caplog.text


def test_steps_with_nothing_to_learn_are_said_as_such_not_blamed_on_the_lr(tmp_path, caplog):
    """A loss of exactly 0 with a gradient of 0 (GRPO: every group's completions rewarded alike) is no sign of a
    bad --lr: a run of them says the batches had nothing to learn."""
    caplog.set_level(logging.WARNING, logger="shardtune")
    guard = TrainingGuard(Path(tmp_path), 1e-3, True)
    guard.check(1, -0.3, 0.7)
    for step in range(2, 7):
        guard.check(step, 0.0, 0.0)
    assert caplog.text.count("the loss and the gradient norm have been exactly 0 for 3 steps in a row "
                             "(steps 2-4): these batches had nothing to learn") == 1
    assert "--lr" not in caplog.text


def test_an_adapter_equal_to_the_init_adapter_it_started_from_is_refused():
    """From --init-adapter, B is not 0: the run learned nothing where every tensor is exactly the starting one
    (compared in the dtype written: a bf16 file read into fp32 weights); one element moved is learning."""
    from shardtune.config import LoraConfig
    from shardtune.train.guard import LearnedNothing, refuse_no_op

    start = {"m.lora_A.weight": torch.randn(4, 8).bfloat16(), "m.lora_B.weight": torch.randn(8, 4).bfloat16()}
    end = {k: v.float() for k, v in start.items()}
    lora = LoraConfig(init_adapter="/runs/sft/adapter")
    with pytest.raises(LearnedNothing, match="every weight is exactly the one --init-adapter /runs/sft/adapter "
                                             "started from"):
        refuse_no_op(end, lora, "grpo", 3, start)
    end["m.lora_B.weight"][2, 1] += 1e-3
    refuse_no_op(end, lora, "grpo", 3, start)
    refuse_no_op({**end, "m.extra": torch.zeros(2)}, lora, "grpo", 3, start)  # not in the file: not its start


def test_an_init_adapter_gone_by_the_save_leaves_the_adapter_written_unchecked(tmp_path, caplog):
    """The starting adapter is read again at the save to compare with: moved or broken since the start, the run's
    adapter is written anyway (said in the log), never lost to a failed comparison."""
    from safetensors.torch import save_file

    from shardtune.config import build_config
    from shardtune.train.recipe import starting_adapter

    caplog.set_level(logging.WARNING, logger="shardtune")
    adapter = tmp_path / "sft-adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 8, "lora_alpha": 16}')
    save_file({"m.lora_A.weight": torch.ones(8, 4), "m.lora_B.weight": torch.zeros(4, 8)},
              str(adapter / "adapter_model.safetensors"))
    cfg = build_config({"model": str(tmp_path), "init-adapter": str(adapter)})
    assert torch.equal(starting_adapter(cfg)["m.lora_A.weight"], torch.ones(8, 4))
    (adapter / "adapter_model.safetensors").write_bytes(b"\0" * 10)  # overwritten mid-run
    assert starting_adapter(cfg) is None
    assert f"--init-adapter {adapter} cannot be read any more" in caplog.text
    assert starting_adapter(build_config({"model": str(tmp_path)})) is None
