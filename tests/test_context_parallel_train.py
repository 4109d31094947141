"""--context-parallel through training: CP = 2 on 2 processes and CP = 2 × DP = 2 on 4 equal one process
with the same global batch in fp32 (first-step loss, every LoRA gradient, the loss curve, validation, the
objective's metrics, the adapter after a few steps), for SFT on packed rows of records of uneven length
(their reference is the *unpacked* one-process run: a record that saw another would change the loss,
axolotl #3608), SFT on unpacked rows whose width the pieces do not divide (padded, never counted), DPO
(the pair's log-probabilities summed over the pieces), and nf4. Each launch runs every case in turn, to
keep process starts few. The cases validate every 2 steps (--eval-every) and at the end, and the 4-process
launch also runs CP = 2 under HSDP (--replicate-groups 2: each replica group is one CP group); 8 processes run
one step with CP groups of 2 inside HSDP shard groups of 4. Runs checkpointed
at CP = 2 resume on one process, and one process's at CP = 2 (another CP size and world size both ways), and end
with the uninterrupted run's adapter. Then the bad input, refused before loading (exit 2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from test_preference_ranks import preference_pairs

from dist_utils import finetune_on_ranks, run_ranks
from tiny import instruction_records, make_model, write_jsonl

TOL = 1e-5
METRICS = ("loss", "grad_norm", "mean_token_accuracy", "rewards/chosen", "rewards/margins", "logps/chosen",
           "logps/rejected", "val_loss")


@pytest.fixture(scope="module")
def cp_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("cp")
    make_model(root / "model", "llama", hidden=64, row_scales=True)  # 64: NF4's blocks divide every weight
    make_model(root / "gpt2", "gpt2")  # learned positions: each piece's must be its place in the whole row
    write_jsonl(root / "train.jsonl", instruction_records(12, seed=4))
    write_jsonl(root / "pairs.jsonl", preference_pairs(8))
    return root


def _case(root: Path, name: str, world: str, **extra) -> tuple[str, dict]:
    data = "pairs.jsonl" if extra.get("objective") == "dpo" else "train.jsonl"
    options = {"model": str(root / "model"), "data": str(root / data), "val-data": str(root / data),
               "out": str(root / f"{name}-{world}"), "dtype": "fp32", "steps": 3, "batch-size": 4, "lr": 1e-2,
               "warmup-steps": 1, "seed": 2, "eval-every": 2, **extra}
    return name, options


def train_cases(rank: int, world_size: int, cases: list[tuple[str, dict]]) -> dict:
    """For each case: the first step's loss and full LoRA gradients (B set non-zero, so that A's gradients
    and DPO's policy-reference difference are not trivially zero), then a short run's metrics and adapter,
    and the CP layouts of step 0's forwards (padded width, width)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    from shardtune.config import build_config
    from shardtune.runtime import distributed
    from shardtune.runtime.memory import MemoryMonitor
    from shardtune.train.adapter import save_adapter
    from shardtune.train.job import setup
    from shardtune.train.recipe import train

    worker = distributed.init_worker()
    results = {}
    for name, options in cases:
        cfg = build_config(options)
        memory = MemoryMonitor(worker.device)
        job = setup(cfg, worker, memory)
        with torch.no_grad():
            g = torch.Generator().manual_seed(5)
            for pname, p in sorted(job.strategy.trainable(job.model).items()):
                if "lora_B" in pname:
                    full = torch.randn(p.shape, generator=g) * 0.2
                    p.copy_(distribute_tensor(full, p.device_mesh, p.placements) if isinstance(p, DTensor) else full)
        forwards = job.batcher.step(job.sampler.global_batch(0), job.sampler.plan, worker.rank, cfg.data.packing)
        layouts = [(f.inputs["shardtune_cp"].layout.length, f.inputs["shardtune_cp"].layout.width)
                   for f in forwards if "shardtune_cp" in f.inputs]
        first = job.step(0)
        grads = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
                 for n, p in job.strategy.trainable(job.model).items()}
        job.model.zero_grad(set_to_none=True)
        out = Path(cfg.output.out)
        out.mkdir(parents=True, exist_ok=True)
        train(job, memory, out)
        save_adapter(job.model, job.strategy, job.built.adapter_keys, out / "adapter", cfg.model.path, job.model_dir)
        memory.close()
        metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()] if rank == 0 else []
        results[name] = {"loss": first.loss, "grads": grads, "metrics": metrics, "layouts": layouts,
                         "context": job.strategy.context.size, "mesh": tuple(job.strategy.mesh.shape)
                         if hasattr(job.strategy, "mesh") else None}
    return results


def _assert_same(ref: dict, got: dict, what: str) -> None:
    assert abs(got["loss"] - ref["loss"]) < TOL, (what, got["loss"], ref["loss"])
    assert ref["grads"] and set(got["grads"]) == set(ref["grads"]), what
    assert any(g.abs().max() > 1e-3 for n, g in ref["grads"].items() if "lora_A" in n), what  # not trivially 0
    for name, g in ref["grads"].items():
        assert (got["grads"][name] - g).abs().max() < TOL, (what, name)
    assert len(got["metrics"]) == len(ref["metrics"]) == 3, what
    for mine, theirs in zip(got["metrics"], ref["metrics"]):
        for key in METRICS:
            if key in theirs:
                assert abs(mine[key] - theirs[key]) < 1e-4 * max(1.0, abs(theirs[key])), (what, key, mine, theirs)


def _assert_adapters(a: Path, b: Path) -> None:
    from safetensors.torch import load_file

    ta, tb = (load_file(d / "adapter" / "adapter_model.safetensors") for d in (a, b))
    assert set(ta) == set(tb) and ta
    for k in ta:
        # After 3 AdamW steps at lr 1e-2 (the first step's gradients are compared at 1e-5 above). AdamW moves
        # each element by lr · m / (√v + 1e-8): where a gradient is ~1e-8, fp32 rounding of ~1e-9 changes the
        # step by ~10% of lr, so 1e-3 is the bound rounding allows; a wrong gradient or update moves by ~lr.
        assert (ta[k] - tb[k]).abs().max() < 1e-3, (a, b, k, (ta[k] - tb[k]).abs().max().item())


@pytest.fixture(scope="module")
def cp_runs(cp_root) -> tuple[dict, list, list]:
    """The cases on 1 process (the references), CP = 2 on 2 and CP = 2 × DP = 2 on 4 (plain and HSDP; GPT-2's
    learned positions on 2, packed, so they restart inside the pieces); both
    SFT runs on unpacked rows also save a checkpoint at step 2, for the resume test."""
    sft, dpo = {"save-every": 2}, {"objective": "dpo"}
    nf4 = {"quantize": "nf4"}
    refs = dict(run_ranks(train_cases, 1, [
        _case(cp_root, "sft", "one", strategy="single", **sft),
        _case(cp_root, "dpo", "one", strategy="single", **dpo),
        _case(cp_root, "nf4", "one", strategy="single", **nf4),
        _case(cp_root, "gpt2", "one", strategy="single", model=str(cp_root / "gpt2")),
    ], timeout=900)[0])
    cp = {"strategy": "fsdp2", "context-parallel": 2}
    two = run_ranks(train_cases, 2, [
        _case(cp_root, "sft-packed", "cp2", packing=True, **cp),
        _case(cp_root, "sft", "cp2", **{"micro-batch-size": 2}, **cp, **sft),
        _case(cp_root, "dpo", "cp2", **{"activation-checkpointing": True}, **cp, **dpo),
        _case(cp_root, "nf4", "cp2", **cp, **nf4),
        _case(cp_root, "gpt2-packed", "cp2", model=str(cp_root / "gpt2"), packing=True, **cp),
    ], timeout=900)
    four = run_ranks(train_cases, 4, [
        _case(cp_root, "sft-packed", "cp2dp2", packing=True, **cp),
        _case(cp_root, "dpo", "cp2dp2", **cp, **dpo),
        _case(cp_root, "sft-hsdp", "cp2dp2", **{"replicate-groups": 2}, **cp),
    ], timeout=900)
    return refs, two, four


def test_context_parallel_trains_like_one_process(cp_root, cp_runs):
    refs, two, four = cp_runs
    for ref in refs.values():  # validated at step 2 (--eval-every 2) and at the end, compared below
        assert [m["step"] for m in ref["metrics"] if "val_loss" in m] == [2, 3]
    assert set(four[0]) == {"sft-packed", "dpo", "sft-hsdp"}
    assert four[0]["sft-hsdp"]["mesh"] == (2, 2) and four[0]["dpo"]["mesh"] == (4,)  # HSDP: replicate × shard
    for world, ranks in (("cp2", two), ("cp2dp2", four)):
        for name, got in ranks[0].items():
            ref = refs[name.split("-")[0]]
            assert got["context"] == 2
            _assert_same(ref, got, f"{name} {world}")
            for other in ranks[1:]:  # every rank computed the same loss and holds the same full gradients
                assert other[name]["loss"] == pytest.approx(got["loss"], abs=1e-6)
            _assert_adapters(cp_root / f"{name.split('-')[0]}-one", cp_root / f"{name}-{world}")
    # the pieces do not divide some rows: they were padded (and the padding counted nothing, above)
    assert any(length > width for name in ("sft", "dpo") for length, width in two[0][name]["layouts"])
    assert all(length % 2 == 0 for r in two for case in r.values() for length, _ in case["layouts"])


def test_context_parallel_groups_inside_larger_hsdp_shard_groups(cp_root, cp_runs):
    """8 ranks, --replicate-groups 2 --context-parallel 2: two replica groups of 4 ranks each shard one copy of
    the weights and hold two CP groups of 2 (the smallest mesh where a CP group is smaller than a shard group:
    two replica groups, shard groups of twice the CP size). So the gradients of a piece are reduce-scattered
    over ranks that hold other records' pieces too, then all-reduced across the replicas. One step (8
    processes on a few cores: the fewest steps that show it) equals one process: its loss, every LoRA gradient,
    the step's logged metrics."""
    refs, _, _ = cp_runs
    eight = run_ranks(train_cases, 8, [_case(cp_root, "sft-hsdp", "cp2r2", strategy="fsdp2", steps=1,
                                             **{"context-parallel": 2, "replicate-groups": 2})], timeout=900)
    ref, got = refs["sft"], eight[0]["sft-hsdp"]
    assert (got["mesh"], got["context"]) == ((2, 4), 2)  # replicate × shard, CP groups of 2 inside each shard group
    assert abs(got["loss"] - ref["loss"]) < TOL, (got["loss"], ref["loss"])
    assert set(got["grads"]) == set(ref["grads"]) and any(g.abs().max() > 1e-3 for g in ref["grads"].values())
    for name, g in ref["grads"].items():
        assert (got["grads"][name] - g).abs().max() < TOL, name
    for other in eight[1:]:
        assert other["sft-hsdp"]["loss"] == pytest.approx(got["loss"], abs=1e-6)
    (mine,), theirs = got["metrics"], ref["metrics"][0]
    for key in ("loss", "grad_norm", "mean_token_accuracy"):
        assert abs(mine[key] - theirs[key]) < 1e-4 * max(1.0, abs(theirs[key])), (key, mine, theirs)


def _resumed(cp_root: Path, source: str, out: str, nproc: int, **extra) -> dict:
    """``out`` as a run stopped right after ``source``'s checkpoint of step 2, resumed through ``finetune`` on
    ``nproc`` ranks with ``extra`` (another strategy, CP size, world size)."""
    import shutil

    (cp_root / out / "checkpoints").mkdir(parents=True)
    shutil.copytree(cp_root / source / "checkpoints" / "step-2", cp_root / out / "checkpoints" / "step-2")
    lines = (cp_root / source / "metrics.jsonl").read_text().splitlines(keepends=True)
    (cp_root / out / "metrics.jsonl").write_text("".join(lines[:2]))
    _, options = _case(cp_root, "sft", "unused", resume=True, **{"save-every": 2}, **extra)
    summary = finetune_on_ranks({**options, "out": str(cp_root / out)}, nproc)
    assert summary["resumed_from_step"] == 2 and summary["world_size"] == nproc, summary
    return summary


def test_a_checkpoint_resumes_onto_another_context_parallel_size(cp_root, cp_runs):
    """CP = 2 on 2 processes → 1 process, and 1 process → CP = 2 on 2: a checkpoint holds the LoRA weights and
    the optimizer state, not the sequence split; both end as the uninterrupted run (its step 3, its validation,
    its adapter). (The test's B was set non-zero before step 1, so a resume that lost the checkpoint's weights
    or optimizer state would end far off.)"""
    refs, _, _ = cp_runs
    down = _resumed(cp_root, "sft-cp2", "sft-cp2-to-one", 1, strategy="single")
    up = _resumed(cp_root, "sft-one", "sft-one-to-cp2", 2, strategy="fsdp2", **{"context-parallel": 2})
    assert (down["context_parallel"], up["context_parallel"]) == (1, 2)
    ref = refs["sft"]["metrics"]
    for out in ("sft-cp2-to-one", "sft-one-to-cp2"):
        metrics = [json.loads(line) for line in (cp_root / out / "metrics.jsonl").read_text().splitlines()]
        assert [m["step"] for m in metrics] == [1, 2, 3], out
        for key in ("loss", "grad_norm", "val_loss"):
            assert abs(metrics[2][key] - ref[2][key]) < 1e-4 * max(1.0, abs(ref[2][key])), (out, key)
        _assert_adapters(cp_root / "sft-one", cp_root / out)


# --- bad input: refused before loading, naming the flags --------------------------------------------------


@pytest.mark.parametrize("extra,words", [
    ({"nproc": 3, "context-parallel": 2, "strategy": "fsdp2"}, ["context-parallel", "does not divide the 3 ranks"]),
    ({"nproc": 2, "context-parallel": 2, "strategy": "ddp"}, ["context-parallel", "fsdp2", "'ddp'"]),
    ({"nproc": 2, "context-parallel": 2, "strategy": "fsdp1"}, ["context-parallel", "fsdp2", "'fsdp1'"]),
    ({"nproc": 4, "context-parallel": 2, "strategy": "fsdp2", "replicate-groups": 4},
     ["context-parallel", "replicate-groups"]),
    ({"nproc": 1, "context-parallel": 2}, ["context-parallel", "does not divide the 1 ranks"]),
    ({"nproc": 2, "context-parallel": 0}, ["context-parallel", "at least 1"]),
    ({"nproc": 4, "context-parallel": 2, "strategy": "fsdp2", "batch-size": 3},
     ["batch-size", "data-parallel groups"]),
])
def test_bad_context_parallel_is_refused_before_loading(cp_root, tmp_path, no_workers, capsys, extra, words):
    from shardtune.cli import main

    args = ["finetune", "--model", str(cp_root / "model"), "--data", str(cp_root / "train.jsonl"),
            "--out", str(tmp_path / "out"), "--dtype", "fp32"]
    for flag, value in extra.items():
        args += [f"--{flag}", str(value)]
    assert main(args) == 2
    err = capsys.readouterr().err
    for word in words:
        assert word in err, (word, err)


def test_context_parallel_refuses_attention_it_cannot_split_and_too_few_heads(tmp_path, no_workers, capsys):
    from shardtune.cli import main

    write_jsonl(tmp_path / "train.jsonl", instruction_records(4))
    for arch, cp, words in (("falcon", 2, ["context-parallel", "falcon", "attention", "without --context-parallel"]),
                            ("llama", 8, ["context-parallel", "4 attention heads", "at most 4"])):
        make_model(tmp_path / arch, arch)
        args = ["finetune", "--model", str(tmp_path / arch), "--data", str(tmp_path / "train.jsonl"), "--out",
                str(tmp_path / f"out-{arch}"), "--nproc", str(cp), "--context-parallel", str(cp), "--strategy",
                "fsdp2", "--batch-size", str(cp)]
        assert main(args) == 2, arch
        err = capsys.readouterr().err
        for word in words:
            assert word in err, (arch, word, err)


def test_planner_counts_pieces_and_auto_turns_cp_on_only_when_nothing_else_fits(cp_root):
    """The planner: a rank's activations shrink with its piece (the exchange buffers added); ``auto`` keeps
    CP off while anything fits without it (activation checkpointing included), and picks the smallest N
    that fits when nothing does."""
    import dataclasses

    from shardtune.config import build_config
    from shardtune.runtime.memory import MB
    from shardtune.train.choice import Search, choose

    options = {"model": str(cp_root / "model"), "data": str(cp_root / "train.jsonl"), "out": "unused",
               "nproc": 4, "strategy": "fsdp2", "dtype": "fp32", "seq-len": 2048, "batch-size": 4,
               "micro-batch-size": 1, "packing": True, "context-parallel": "auto", "fsdp-unit": "part"}
    cfg = build_config(options)
    search = Search(cfg)

    def peak(cp: int, ac: bool) -> float:
        setting = dataclasses.replace(search.setting("fsdp2", 4, 1), context_parallel=cp, activation_checkpointing=ac)
        return search.predict(setting)

    one, two, four = peak(1, True), peak(2, True), peak(4, True)
    assert two.terms["activations"] < 0.75 * one.terms["activations"]
    assert four.terms["activations"] < two.terms["activations"]
    assert one.peak_mb > two.peak_mb > four.peak_mb
    # per-part units: the MLPs stay untiled whatever --mlp-tile auto would do (tiles go with whole layers)
    peaks = {(cp, ac): peak(cp, ac).peak_mb for cp in (1, 2, 4) for ac in (False, True)}
    chosen = []
    for budget in (peaks[1, False] + 1, peaks[1, True] + 0.01, (peaks[1, True] + peaks[2, True]) / 2,
                   (peaks[2, True] + peaks[4, True]) / 2):
        decided, _, why = choose(dataclasses.replace(cfg, parallel=dataclasses.replace(
            cfg.parallel, memory_per_rank=f"{budget * MB:.0f}B")), search=search)
        cp = min(n for n in (1, 2, 4) if min(peaks[n, False], peaks[n, True]) <= budget)  # the smallest that fits
        expected = (cp, peaks[cp, False] > budget)  # and checkpointing only when it must
        got = (decided.parallel.context_parallel, decided.parallel.activation_checkpointing)
        assert got == expected, (budget, got, why)
        chosen.append(got[0])
    assert chosen == [1, 1, 2, 4]
