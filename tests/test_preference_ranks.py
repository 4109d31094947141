"""Preference objectives on N ranks train exactly like 1 rank with the same global batch of pairs:
loss curve, TRL's metrics, gradient norms and the adapter, under fsdp2, fsdp1, ddp and fsdp2 + nf4, and
packed like unpacked. Through the public API, ``shardtune.finetune``, on ranks started as plain torchrun starts
them (dist_utils.finetune_on_ranks: forked from a preloaded server; the launcher's own workers are
tested in test_launch.py and test_preference_run.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dist_utils import finetune_on_ranks, run_ranks, trained_job
from tiny import make_model, write_jsonl

METRIC_KEYS = ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen",
               "logps/rejected", "rewards/accuracies")


def preference_pairs(n: int) -> list[dict]:
    """Pairs of different lengths (so that padding, packing and splits all matter)."""
    return [{"prompt": f"Q{i}: what is {i} times {i % 5 + 2}? " + "Think. " * (i % 3),
             "chosen": f"It is {i * (i % 5 + 2)}." + " Sure." * (i % 4),
             "rejected": f"Maybe {i + 3}" + ", or not" * (i % 5)} for i in range(n)]


@pytest.fixture(scope="module")
def pref_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("pref")
    make_model(root / "model", "llama", hidden=64, row_scales=True)  # 64: NF4's blocks divide every weight
    write_jsonl(root / "pairs.jsonl", preference_pairs(16))
    return root


def _options(root: Path, name: str, objective: str, **extra) -> dict:
    return {"model": str(root / "model"), "data": str(root / "pairs.jsonl"), "out": str(root / name),
            "objective": objective, "dtype": "fp32", "steps": 3, "batch-size": 8, "lr": 1e-2, "warmup-steps": 1,
            "seed": 3, "lora-targets": "all-linear", **extra}


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _assert_same_run(a: Path, b: Path, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    from safetensors.torch import load_file

    ma, mb = _metrics(a), _metrics(b)
    assert len(ma) == len(mb) == 3
    for key in METRIC_KEYS:
        torch.testing.assert_close(torch.tensor([m[key] for m in mb]), torch.tensor([m[key] for m in ma]),
                                   rtol=rtol, atol=atol, msg=key)
    assert ma[-1]["loss"] < ma[0]["loss"]  # it learned: the comparison is not of an idle adapter
    ta, tb = (load_file(d / "adapter" / "adapter_model.safetensors") for d in (a, b))
    assert set(ta) == set(tb) and ta
    # Adam divides each gradient by its own size, so an element whose gradient is nearly 0 moves by up to
    # lr (1e-2) whatever its rounding: elements may differ by a small fraction of lr, never by whole steps.
    for k in ta:
        torch.testing.assert_close(tb[k], ta[k], rtol=1e-3, atol=1e-4, msg=k)


@pytest.mark.parametrize("objective,strategies", [
    ("dpo", ["fsdp2", "fsdp1", "ddp"]),
    ("orpo", ["fsdp2"]),
    ("simpo", ["ddp"]),
])
def test_two_ranks_equal_one_rank(pref_root, objective, strategies):
    one = _options(pref_root, f"{objective}-one", objective, strategy="single", nproc=1)
    summary = finetune_on_ranks(one, 1)
    assert summary["train_loss_first"] == pytest.approx(0.6931472, rel=1e-6) or objective != "dpo"  # ln 2
    for strategy in strategies:
        # 2 ranks × micro-batch 2 × 2 accumulation steps: the same 8 pairs a step, split differently
        two = _options(pref_root, f"{objective}-{strategy}", objective, strategy=strategy, nproc=2,
                       **{"micro-batch-size": 2})
        assert finetune_on_ranks(two, 2)["world_size"] == 2
        _assert_same_run(Path(one["out"]), Path(two["out"]))


def test_two_ranks_equal_one_rank_with_nf4(pref_root):
    """The reference under --quantize nf4 is the 4-bit base the policy sees, on every rank."""
    one = _options(pref_root, "nf4-one", "dpo", strategy="single", nproc=1, quantize="nf4")
    two = _options(pref_root, "nf4-fsdp2", "dpo", strategy="fsdp2", nproc=2, quantize="nf4",
                   **{"micro-batch-size": 2})
    assert finetune_on_ranks(one, 1)["train_loss_first"] == pytest.approx(0.6931472, rel=1e-6)
    finetune_on_ranks(two, 2)
    _assert_same_run(Path(one["out"]), Path(two["out"]), rtol=1e-4, atol=1e-5)


def test_packed_pairs_train_like_padded_ones(pref_root):
    padded = _options(pref_root, "dpo-padded", "dpo", strategy="single", nproc=1, **{"seq-len": 96})
    packed = _options(pref_root, "dpo-packed", "dpo", strategy="fsdp2", nproc=2, packing=True,
                      **{"seq-len": 96, "micro-batch-size": 1})
    finetune_on_ranks(padded, 1)
    summary = finetune_on_ranks(packed, 2)
    assert summary["packing"] and summary["fill_ratio"] > 0.5
    _assert_same_run(Path(padded["out"]), Path(packed["out"]))


def first_step_grads(rank: int, world_size: int, options: dict) -> dict:
    from torch.distributed.tensor import DTensor, distribute_tensor

    from shardtune.config import build_config
    from shardtune.runtime import distributed
    from shardtune.runtime.memory import MemoryMonitor
    from shardtune.train.job import setup

    cfg = build_config(options)
    worker = distributed.init_worker()
    memory = MemoryMonitor(worker.device)
    job = setup(cfg, worker, memory)
    with torch.no_grad():  # B ≠ 0, the same on every rank: policy and reference differ, A gets a gradient
        g = torch.Generator().manual_seed(5)
        for name, p in sorted(job.strategy.trainable(job.model).items()):
            if "lora_B" in name:
                full = torch.randn(p.shape, generator=g) * 0.2
                p.copy_(distribute_tensor(full, p.device_mesh, p.placements) if isinstance(p, DTensor) else full)
    result = job.step(0)
    grads = {}
    for name, p in job.strategy.trainable(job.model).items():
        grads[name] = (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
    memory.close()
    return {"loss": result.loss, "grads": grads}


def test_two_ranks_fsdp2_gradients_equal_one_rank(pref_root):
    """Gradients themselves, with a non-zero B (at B = 0 the DPO gradient of A is 0 on both sides)."""
    one = run_ranks(first_step_grads, 1, _options(pref_root, "g1", "dpo", strategy="single"))[0]
    two = run_ranks(first_step_grads, 2, _options(pref_root, "g2", "dpo", strategy="fsdp2",
                                                  **{"micro-batch-size": 1}))[0]
    assert one["loss"] == pytest.approx(two["loss"], rel=1e-6) and one["loss"] != pytest.approx(0.6931472, rel=1e-3)
    assert set(one["grads"]) == set(two["grads"])
    for name, g in one["grads"].items():
        assert g.abs().sum() > 0, name
        torch.testing.assert_close(two["grads"][name], g, rtol=1e-4, atol=1e-7, msg=name)


def reference_after_a_step(rank: int, world_size: int, options: dict) -> dict:
    """After one optimizer step under the strategy: the reference and the policy log-probs of every pair."""
    from shardtune.train.data.batch import sequence_sums
    from shardtune.train.loss_head import score
    from shardtune.train.reference import Reference

    job, memory, _ = trained_job(options)
    job.model.eval()
    fwd = job.batcher.padded(list(range(4)))
    with torch.no_grad():
        reference = Reference(job.objective).values(job.model, fwd)
        policy = sequence_sums(score(job.model, fwd.inputs, fwd.targets).logps, fwd).view(-1, 2)
    memory.close()
    return {"reference": reference, "policy": policy, "ids": fwd.inputs["input_ids"], "targets": fwd.targets,
            "owners": fwd.owners}


def test_fsdp1_reference_is_the_base_model_not_the_policy(pref_root):
    """TRL#6527: under FSDP1 the wrapper hides the peft model, and a reference pass that asks the peft model
    to disable its adapter silently runs the policy. Ours must give the bare base model's log-probs."""
    from transformers import AutoModelForCausalLM

    got = run_ranks(reference_after_a_step, 2, _options(pref_root, "fsdp1-ref", "dpo", strategy="fsdp1", steps=1,
                                                         lr=5e-2, **{"micro-batch-size": 2}))[0]
    base = AutoModelForCausalLM.from_pretrained(pref_root / "model", dtype=torch.float32).eval()
    targets, owners = got["targets"], got["owners"]
    with torch.no_grad():  # right-padded rows: causal attention never sees the padding, no mask needed
        logps = base(input_ids=got["ids"]).logits.log_softmax(-1).gather(-1, targets.clamp(min=0)[..., None])
    logps = torch.where(owners >= 0, logps.squeeze(-1), 0.0)
    expected = torch.zeros(9).index_add(0, torch.where(owners >= 0, owners, 8).flatten(), logps.flatten())
    expected = expected[:8].view(-1, 2)
    torch.testing.assert_close(got["reference"], expected, rtol=1e-5, atol=1e-5)
    assert (got["policy"] - got["reference"]).abs().max() > 1e-2  # the step moved the policy away from it
