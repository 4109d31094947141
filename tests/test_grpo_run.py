"""GRPO runs as a user starts them (``shardtune finetune --objective grpo``): N ranks train like one, a run
stopped mid generation batch resumes on the same completions, and bad reward functions and options stop the
run with exit 2 naming them.

One 1-rank run (num_iterations 2 and β > 0, so that the old policy's and the reference's log-probs are used,
a checkpoint after each step) is the baseline of the module, for 2 FSDP2 and 2 DDP ranks; a 4-bit base
(--quantize nf4) has its own 1-rank baseline. fsdp1 is refused for GRPO (exit 2, below).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from shardtune.cli import main

import cli_process
from tiny import make_model, write_jsonl

G = 4
REWARD_FILE = '''
def digits(prompts, completions, completion_ids, answer, log_metric, log_extra, **fields):
    """Varies within a group: digits in the completion, and the ids' sum. Logs as TRL's functions may."""
    text = [c if isinstance(c, str) else c[0]["content"] for c in completions]
    log_metric("digits/rows", len(text))
    log_extra("answer", list(answer))
    return [sum(ch.isdigit() for ch in t) / 4 + (sum(ids) % 7) / 7 for t, ids in zip(text, completion_ids)]


def picky(prompts, completions, answer, **fields):
    if any(a == "6" for a in answer):
        raise ValueError("no sixes")
    return [0.0] * len(completions)


def bails(prompts, completions, **fields):
    import os
    os._exit(0)


def short(prompts, completions, **fields):
    return [0.0]


def never(prompts, completions, **fields):
    return [None] * len(completions)


def sometimes(prompts, completions, completion_ids, answer, **fields):
    """Not applicable to the prompts whose answer is 0 (two of them); the ids' sum elsewhere."""
    return [None if a == "0" else (sum(ids) % 7) / 7 for ids, a in zip(completion_ids, answer)]


def enormous(prompts, completions, completion_ids, **fields):
    """Within float32, but their spread's square is not."""
    return [3e38 * (sum(ids) % 2) for ids in completion_ids]


def first_step_only(prompts, completions, trainer_state, **fields):
    """Tells completions apart at the first step only: then nothing is left to learn."""
    return [float(i % 2) if trainer_state.global_step == 0 else 0.0 for i in range(len(completions))]
'''


def prompt_records() -> list[dict]:
    strings = [{"prompt": f"Question {i}: what is {i}+{i}?", "answer": str(2 * i)} for i in range(6)]
    chats = [{"prompt": [{"role": "user", "content": f"say {i}"}], "answer": str(i)} for i in range(2)]
    return strings + chats


@pytest.fixture(scope="module")
def grpo_root(tmp_path_factory, tiny_llama) -> Path:
    from datasets import Dataset

    root = tmp_path_factory.mktemp("grpo")
    write_jsonl(root / "prompts.jsonl", prompt_records())
    Dataset.from_list(prompt_records()[:6]).save_to_disk(root / "hub")  # the string prompts
    (root / "rewards.py").write_text(REWARD_FILE)
    (root / "model").symlink_to(tiny_llama, target_is_directory=True)
    return root


def argv(root: Path, out: str, *extra: str, data: str = "prompts.jsonl") -> list[str]:
    return ["finetune", "--model", str(root / "model"), "--data", str(root / data), "--out", str(root / out),
            "--objective", "grpo", "--reward", f"{root / 'rewards.py'}:digits", "--reward", "format=[0-9]",
            "--reward-weights", "1,0.5", "--num-generations", str(G), "--batch-size", "8",
            "--max-completion-length", "6", "--seq-len", "48", "--num-iterations", "2", "--grpo-beta", "0.05",
            "--dtype", "fp32", "--lr", "3e-2", "--warmup-steps", "0", "--seed", "3", *extra]


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def completions(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]


def same_training(a: Path, b: Path, steps: int) -> None:
    ma, mb = metrics(a), metrics(b)
    assert [m["step"] for m in ma] == [m["step"] for m in mb] == list(range(1, steps + 1))
    for key in ("loss", "grad_norm", "reward", "reward_std", "rewards/digits/mean", "rewards/format/mean", "kl",
                "clip_ratio/region_mean", "completions/mean_length", "completions/clipped_ratio"):
        torch.testing.assert_close(torch.tensor([m[key] for m in mb], dtype=torch.float64),
                                   torch.tensor([m[key] for m in ma], dtype=torch.float64), rtol=1e-5, atol=1e-6,
                                   msg=key)
    # the same completions, rewards and advantages, sample by sample
    ca, cb = completions(a), completions(b)
    assert [(c["step"], c["prompt"], c["completion"], c["rewards"]) for c in ca] == \
        [(c["step"], c["prompt"], c["completion"], c["rewards"]) for c in cb]
    torch.testing.assert_close(torch.tensor([c["advantage"] for c in cb]), torch.tensor([c["advantage"] for c in ca]),
                               rtol=1e-5, atol=1e-6)
    wa, wb = (load_file(out / "adapter" / "adapter_model.safetensors") for out in (a, b))
    assert wa.keys() == wb.keys()
    # Adam divides each element's gradient by its own running size: where that is tiny (lora_A's gradients start
    # at step 2, B being 0 at step 1), rounding-level differences move an element by a small fraction of lr
    # (3e-2); a wrong gradient moves it by whole steps. Hence a thousandth of lr (the metrics above are tighter).
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=1e-5, atol=3e-5, msg=k)


@pytest.fixture(scope="module")
def one_rank(grpo_root) -> Path:
    code = main(argv(grpo_root, "one", "--strategy", "single", "--steps", "4", "--save-every", "1",
                     "--keep-last", "4"))
    assert code == 0
    return grpo_root / "one"


def test_a_run_trains_and_logs_trl_metrics(one_rank):
    rows = metrics(one_rank)
    assert len(rows) == 4
    first, last = rows[0], rows[-1]
    for key in ("reward", "reward_std", "rewards/digits/mean", "rewards/format/mean", "completions/mean_length",
                "completions/clipped_ratio", "kl", "clip_ratio/low_mean", "clip_ratio/high_mean",
                "clip_ratio/region_mean", "frac_reward_zero_std"):
        assert key in last, key
    assert first["kl"] == 0.0  # the adapter starts as the base: policy = reference
    assert last["kl"] > 0  # and has moved away from it
    # num_iterations 2: steps 1-2 train on one generation batch, steps 3-4 on the next
    assert rows[0]["reward"] == rows[1]["reward"] and rows[2]["reward"] == rows[3]["reward"]
    samples = completions(one_rank)
    assert {s["step"] for s in samples} == {1, 3} and all(isinstance(s["completion"], str) for s in samples)
    # what the functions logged (TRL's log_metric, log_extra): the step's mean, and each sample's own value
    assert [r["digits/rows"] for r in rows] == [8] * 4
    answers = {str(r["prompt"]): r["answer"] for r in prompt_records()}
    assert all(s["extra"] == {"answer": answers[str(s["prompt"])]} for s in samples)
    assert json.loads((one_rank / "summary.json").read_text())["objective"] == "grpo"


def test_two_fsdp2_ranks_generating_from_row_shards_train_like_one(grpo_root, one_rank, monkeypatch):
    """FSDP2 where generation computes from the row shards (``EXCHANGE_PAYS_FROM`` lowered to the tiny model's
    layers), each rank its own rows (``REPLICATED_READS_UP_TO`` at 0): no layer gathered to generate, and the same
    completions, losses and adapter as one rank."""
    from shardtune.train import choice

    monkeypatch.setitem(choice.EXCHANGE_PAYS_FROM, "cpu", 1)
    monkeypatch.setitem(choice.REPLICATED_READS_UP_TO, "cpu", 0)
    assert main(argv(grpo_root, "two-exchanged", "--strategy", "fsdp2", "--nproc", "2", "--steps", "4",
                     "--micro-batch-size", "2")) == 0
    summary = json.loads((grpo_root / "two-exchanged" / "summary.json").read_text())
    assert summary["run_plan"]["generation_exchanged"] is True and summary["run_plan"]["generation_gathered"] is False
    assert summary["run_plan"]["generation_replicated"] is False
    same_training(one_rank, grpo_root / "two-exchanged", 4)


def test_two_fsdp2_ranks_training_from_row_shards_train_like_one(grpo_root, one_rank, monkeypatch):
    """FSDP2 where training computes from the row shards too (``EXCHANGED_HIDDENS`` lowered so that the exchange
    pays for the tiny model): the frozen projections never enter FSDP, their forward and backward (recomputed
    under activation checkpointing) move activations between the ranks, both ranks sample all the rows (the tiny
    KV cache is within ``REPLICATED_READS_UP_TO``), and completions, losses, gradient norms and adapter are one
    rank's."""
    from shardtune.train import choice

    monkeypatch.setitem(choice.EXCHANGE_PAYS_FROM, "cpu", 1)
    monkeypatch.setattr(choice, "EXCHANGED_HIDDENS", 0)
    assert main(argv(grpo_root, "two-layers-exchanged", "--strategy", "fsdp2", "--nproc", "2", "--steps", "4",
                     "--micro-batch-size", "2", "--activation-checkpointing")) == 0
    plan = json.loads((grpo_root / "two-layers-exchanged" / "summary.json").read_text())["run_plan"]
    assert plan["layers_exchanged"] is True and plan["generation_exchanged"] is True
    assert plan["generation_replicated"] is True
    same_training(one_rank, grpo_root / "two-layers-exchanged", 4)


def test_hsdp_ranks_training_from_row_shards_train_like_one(grpo_root, one_rank, monkeypatch):
    """HSDP (4 ranks in 2 replica groups) with the layers exchanged in training: each group's 2 ranks split the
    rows between them and exchange only within their group, where each rank samples all of its group's rows;
    completions, losses and adapter are one rank's."""
    from shardtune.train import choice

    monkeypatch.setitem(choice.EXCHANGE_PAYS_FROM, "cpu", 1)
    monkeypatch.setattr(choice, "EXCHANGED_HIDDENS", 0)
    assert main(argv(grpo_root, "hsdp-layers-exchanged", "--strategy", "fsdp2", "--nproc", "4",
                     "--replicate-groups", "2", "--steps", "4", "--micro-batch-size", "2")) == 0
    plan = json.loads((grpo_root / "hsdp-layers-exchanged" / "summary.json").read_text())["run_plan"]
    assert plan["layers_exchanged"] is True and plan["replicate_groups"] == 2 and plan["generation_replicated"]
    same_training(one_rank, grpo_root / "hsdp-layers-exchanged", 4)


@pytest.mark.parametrize("strategy", ["fsdp2", "ddp"])
def test_two_ranks_train_like_one(grpo_root, one_rank, strategy):
    """2 ranks, each generating and training its half of every batch, two completions per forward: FSDP2 (the
    weights gathered for generation) and DDP (each rank generates on its own, outside DDP's wrapper)."""
    code = main(argv(grpo_root, f"two-{strategy}", "--strategy", strategy, "--nproc", "2", "--steps", "4",
                     "--micro-batch-size", "2"))
    assert code == 0
    summary = json.loads((grpo_root / f"two-{strategy}" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["strategy"] == strategy
    if strategy == "fsdp2":  # the tiny model fits gathered: generation keeps its weights gathered (one gather), for
        # the old and the reference log-probs and the training step after it too
        assert summary["run_plan"]["generation_gathered"] is True and summary["run_plan"]["generation_carried"] is True
    same_training(one_rank, grpo_root / f"two-{strategy}", 4)


def test_two_fsdp2_ranks_train_like_one_on_a_4bit_base(grpo_root, monkeypatch):
    """--quantize nf4: 2 FSDP2 ranks (gathering the 4-bit data to generate), and 2 ranks computing from the 4-bit
    row shards in generation and training (the rules lowered to the tiny model's layers), against 1 rank on the
    same 4-bit base; 2 steps of one iteration each, so the second batch is sampled by the trained adapter, and
    β > 0, so the reference is the 4-bit base with the adapter off."""
    from shardtune.train import choice

    from tiny import make_model

    model = make_model(grpo_root / "model-64", "llama", hidden=64, row_scales=True)  # NF4's blocks divide it
    two = ("--strategy", "fsdp2", "--nproc", "2", "--micro-batch-size", "2")
    runs = {"nf4-one": ("--strategy", "single"), "nf4-two": two,
            "nf4-two-exchanged": (*two, "--activation-checkpointing")}
    for out, extra in runs.items():
        if out == "nf4-two-exchanged":
            monkeypatch.setitem(choice.EXCHANGE_PAYS_FROM, "cpu", 1)
            monkeypatch.setattr(choice, "EXCHANGED_HIDDENS", 0)
        args = argv(grpo_root, out, "--quantize", "nf4", "--steps", "2", "--num-iterations", "1", *extra)
        args[args.index("--model") + 1] = str(model)
        assert main(args) == 0
    exchanged = json.loads((grpo_root / "nf4-two-exchanged" / "summary.json").read_text())["run_plan"]
    assert exchanged["generation_exchanged"] is True and exchanged["layers_exchanged"] is True
    assert exchanged["generation_replicated"] is True and exchanged["generation_dequantized"] is True
    same_training(grpo_root / "nf4-one", grpo_root / "nf4-two-exchanged", 2)
    summary = json.loads((grpo_root / "nf4-two" / "summary.json").read_text())
    # the tiny model fits gathered and dequantized: each 4-bit weight is dequantized once per generation (the
    # one rank dequantizes in every forward), and the completions below are the same
    assert summary["world_size"] == 2 and summary["run_plan"]["generation_dequantized"] is True
    rows = metrics(grpo_root / "nf4-one")
    assert rows[1]["kl"] > 0 and rows[0]["grad_norm"] > 0  # it learned, away from the 4-bit reference
    same_training(grpo_root / "nf4-one", grpo_root / "nf4-two", 2)


def test_a_run_stopped_mid_generation_batch_resumes_on_the_same_completions(grpo_root, one_rank):
    part = grpo_root / "part"
    shutil.copytree(one_rank, part)
    # as if stopped after step 3: the second generation batch is half used (num_iterations 2)
    shutil.rmtree(part / "checkpoints" / "step-4")
    (part / "summary.json").unlink()
    shutil.rmtree(part / "adapter")
    assert (part / "checkpoints" / "step-3" / "extra.pt").is_file()
    code = main(argv(grpo_root, "part", "--strategy", "single", "--steps", "4", "--save-every", "1",
                     "--keep-last", "4", "--resume"))
    assert code == 0
    same_training(one_rank, part, 4)


def test_a_resume_with_other_groups_samples_its_batch_anew_and_drops_a_torn_sample_line(grpo_root, one_rank,
                                                                                      capfd):
    """Resumed mid generation batch with another --num-generations: the saved batch (groups of 4) cannot be
    trained on, so the step samples its own (said), not an IndexError; completions.jsonl's last line, cut by an
    interrupted write, is dropped with a note as metrics.jsonl's is, not a JSONDecodeError."""
    part = grpo_root / "regroup"
    shutil.copytree(one_rank, part)
    shutil.rmtree(part / "checkpoints" / "step-4")
    (part / "summary.json").unlink()
    shutil.rmtree(part / "adapter")
    with open(part / "completions.jsonl", "a") as f:
        f.write('{"step": 4, "prompt": "Quest')
    capfd.readouterr()
    code = main(argv(grpo_root, "regroup", "--strategy", "single", "--steps", "4", "--num-generations", "2",
                     "--resume"))
    err = capfd.readouterr().err
    assert code == 0, err
    assert "the checkpoint's generation batch (step 3 on) was made of 8 completions, 4 per prompt (now --batch-size " \
           "8, --num-generations 2); it is sampled anew" in err
    assert "completions.jsonl: its last line (28 bytes) was cut off by an interrupted write" in err
    kept = completions(part)
    assert [c["step"] for c in kept] == [c["step"] for c in completions(one_rank) if c["step"] <= 3] + [4] * 4
    assert kept[:-4] == completions(one_rank)
    # another temperature: the saved batch's log-probs are the old one's; sampled anew as well
    shutil.rmtree(part)
    shutil.copytree(one_rank, part)
    shutil.rmtree(part / "checkpoints" / "step-4")
    (part / "summary.json").unlink()
    shutil.rmtree(part / "adapter")
    assert main(argv(grpo_root, "regroup", "--strategy", "single", "--steps", "4", "--temperature", "0.5",
                     "--resume")) == 0
    assert "was made at --temperature 1, its log-probs too (now 0.5); it is sampled anew" in capfd.readouterr().err


def test_a_checkpoint_with_a_damaged_state_file_is_skipped_and_the_run_resumes_exactly(grpo_root, one_rank, capfd):
    """A checkpoint whose generation batch (extra.pt) is garbage, or whose rank's RNG states are missing, is
    skipped with a warning naming the file, as one with damaged weights is: resumed from the one before, the
    run is the uninterrupted one (not a silently different run, not a crash halfway through loading, exit 3)."""
    part = grpo_root / "damaged"
    shutil.copytree(one_rank, part)
    shutil.rmtree(part / "checkpoints" / "step-4")
    (part / "summary.json").unlink()
    shutil.rmtree(part / "adapter")
    (part / "checkpoints" / "step-3" / "extra.pt").write_bytes(b"not a checkpoint")
    (part / "checkpoints" / "step-2" / "rng" / "rank-0.pt").unlink()
    capfd.readouterr()
    code = main(argv(grpo_root, "damaged", "--strategy", "single", "--steps", "4", "--save-every", "1",
                     "--keep-last", "4", "--resume"))
    err = capfd.readouterr().err
    assert code == 0, err
    assert f"skipping checkpoint {part / 'checkpoints' / 'step-3'}: its file " \
           f"{part / 'checkpoints' / 'step-3' / 'extra.pt'} is unreadable" in err
    assert f"its file {part / 'checkpoints' / 'step-2' / 'rng' / 'rank-0.pt'} is missing" in err
    assert "(step 1)" in err  # resumed from the one before
    same_training(one_rank, part, 4)


def test_off_policy_masking_drops_completions_the_policy_moved_away_from(grpo_root, one_rank):
    """--off-policy-mask-threshold on the module's 1-rank run (num_iterations 2): the first step of a generation
    batch trains on it as sampled, so nothing is masked and the step is the one without; on the second, the
    completions with a negative advantage that the first step made less likely (mean per-token log-ratio of the
    old policy to the new > δ) lose their policy loss: another loss, another adapter. (Which completions, and
    that it matches TRL, is tests/test_grpo_oracle.py.)"""
    code = main(argv(grpo_root, "masked", "--strategy", "single", "--steps", "2", "--off-policy-mask-threshold",
                     "1e-4"))
    assert code == 0
    plain, masked = metrics(one_rank)[:2], metrics(grpo_root / "masked")
    for key in ("loss", "grad_norm", "kl", "reward", "clip_ratio/region_mean"):
        assert masked[0][key] == pytest.approx(plain[0][key], rel=1e-6, abs=1e-9), key
    assert masked[1]["reward"] == plain[1]["reward"]  # the same generation batch
    assert masked[1]["loss"] != pytest.approx(plain[1]["loss"], rel=1e-3, abs=1e-6)
    from shardtune.train.checkpoint_adapter import adapter_from_checkpoint

    step2 = adapter_from_checkpoint(one_rank / "checkpoints" / "step-2", grpo_root / "unmasked-step-2")
    before = load_file(step2 / "adapter_model.safetensors")
    after = load_file(grpo_root / "masked" / "adapter" / "adapter_model.safetensors")
    assert before.keys() == after.keys()
    assert any(not torch.allclose(before[k], after[k], rtol=1e-4, atol=1e-6) for k in before)


def test_off_policy_mask_threshold_refused_where_it_cannot_mask(grpo_root, capsys, no_workers):
    base = argv(grpo_root, "bad")
    for value in ("0", "-0.5", "nan", "inf"):
        _fails(capsys, main([*base, "--off-policy-mask-threshold", value]), "option 'off-policy-mask-threshold'")
    _fails(capsys, main([*base, "--off-policy-mask-threshold", "0.5", "--num-iterations", "1"]),
           "option 'off-policy-mask-threshold' (0.5)", "never mask", "--num-iterations 2", "--vllm-url")
    sft = ["finetune", "--model", str(grpo_root / "model"), "--data", str(grpo_root / "prompts.jsonl"), "--out",
           str(grpo_root / "bad"), "--off-policy-mask-threshold", "0.5"]
    _fails(capsys, main(sft), "option 'off-policy-mask-threshold' applies to --objective grpo only")


def test_context_parallelism_refused_not_crashed(grpo_root, capsys, no_workers):
    """Each rank samples and trains on its own completions: the ranks of a CP group would share none, so
    --context-parallel is refused before a worker starts (it once failed inside the first step), and
    ``plan`` weighs no CP size for GRPO."""
    base = argv(grpo_root, "bad", "--nproc", "2", "--strategy", "fsdp2")
    for strategy in ([], ["--strategy", "auto"]):
        _fails(capsys, main([*base, *strategy, "--context-parallel", "2"]),
               "option 'context-parallel' does not split --objective grpo", "leave --context-parallel out")
    assert not (grpo_root / "bad").exists()
    assert main(["plan", *base[1:], "--memory-per-rank", "2GiB", "--seq-len", "max", "--json"]) == 0
    assert not any(" cp" in row for row in json.loads(capsys.readouterr().out)["longest"])


def _fails(capsys, code: int, *expected: str) -> None:
    err = capsys.readouterr().err
    assert code == 2, err
    for text in expected:
        assert text in err, err


def test_reward_problems_found_before_workers_start(grpo_root, capsys, no_workers):
    root = grpo_root
    base = argv(root, "bad")
    swap = base.index(f"{root / 'rewards.py'}:digits")

    def with_reward(spec: str) -> list[str]:
        return [*base[:swap], spec, *base[swap + 1:]]

    _fails(capsys, main(with_reward(f"{root / 'missing.py'}:digits")), "missing.py", "--reward")
    _fails(capsys, main(with_reward(f"{root / 'rewards.py'}:nothing")), "has no 'nothing'",
           "bails, digits, enormous, first_step_only, never, picky, short, sometimes")
    _fails(capsys, main(with_reward("no_such_module_here:fn")), "no_such_module_here")
    # a record field named as an argument the functions get from shardtune: named by line, before any model loads
    write_jsonl(root / "reserved.jsonl", [*prompt_records()[:2], {"prompt": "2+2=", "completions": "4"}])
    bad_data = [*base]
    bad_data[bad_data.index("--data") + 1] = str(root / "reserved.jsonl")
    _fails(capsys, main(bad_data), "reserved.jsonl:3: the records have a field named 'completions', which reward "
           "functions receive from shardtune itself")
    _fails(capsys, main([*base, "--batch-size", "6"]), "option 'batch-size' (6)", "--num-generations 4")
    _fails(capsys, main([*base, "--reward-weights", "1,x"]), "option 'reward-weights'")
    _fails(capsys, main([*base, "--strategy", "fsdp1", "--nproc", "2"]), "fsdp1", "use fsdp2")
    sft = ["finetune", "--model", str(root / "model"), "--data", str(root / "prompts.jsonl"), "--out",
           str(root / "bad"), "--num-generations", "4"]
    _fails(capsys, main(sft), "option 'num-generations' applies to --objective grpo only")
    _fails(capsys, main([*base, "--top-p", "0"]), "option 'top-p'")
    _fails(capsys, main([*base, "--temperature", "0"]), "option 'temperature': --temperature 0 samples greedily",
           "the 4 completions of a prompt come out alike")
    _fails(capsys, main([*base, "--top-k", "1"]), "option 'top-k': --top-k 1 samples greedily")
    _fails(capsys, main([*base, "--reward-weights", "0,0"]), "option 'reward-weights' (0,0) weighs every --reward 0")


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_reward_function_that_raises_stops_the_run_naming_it_and_the_prompt(grpo_root, capsys, ranks):
    """The prompts from a ``datasets`` folder (save_to_disk) this time. On 2 FSDP2 ranks, whose generation leaves the
    weights gathered for the training (``generation_carried``), the failure comes between the two: raised on every
    rank, it ends the run 2 with the same message, none left waiting."""
    spread = ("--strategy", "single") if ranks == 1 else ("--strategy", "fsdp2", "--nproc", "2")
    base = argv(grpo_root, f"raises-{ranks}", *spread, "--steps", "1", "--num-iterations", "1",
                "--grpo-beta", "0", "--batch-size", "24", data="hub")  # every prompt in the first batch
    swap = base.index(f"{grpo_root / 'rewards.py'}:digits")
    base[swap] = f"{grpo_root / 'rewards.py'}:picky"
    i = base.index("--reward-weights")
    del base[i:i + 2]
    del base[base.index("format=[0-9]") - 1:base.index("format=[0-9]") + 1]
    if ranks == 2:
        assert main(["plan", *base[1:], "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["run_plan"]["generation_carried"] is True
    code = main(base)
    err = capsys.readouterr().err
    assert code == 2, err
    for text in ("reward function 'picky'", "ValueError: no sixes", "what is 3+3?"):
        assert text in err, err
    # said once, by the launcher naming the rank: the worker's own closing line (after a progress bar that was
    # still drawn) is not relayed as well
    assert err.count("ValueError: no sixes") == 1, err


def test_a_reward_function_that_ends_its_process_quietly_fails_the_run(grpo_root, capsys):
    """os._exit(0) in a reward function ends the worker with status 0 mid-run: exit 2 saying the run did not
    finish and what may have ended it, never a success."""
    base = _only_reward(argv(grpo_root, "bails", "--strategy", "single", "--steps", "1"), grpo_root, "bails")
    _fails(capsys, main(base), "the workers exited with status 0 but wrote no new", "os._exit",
           "the run did not finish")


def _only_reward(base: list[str], root: Path, name: str) -> list[str]:
    """``base`` with ``name`` of the rewards file as its one reward function."""
    out = list(base)
    out[out.index(f"{root / 'rewards.py'}:digits")] = f"{root / 'rewards.py'}:{name}"
    del out[out.index("--reward-weights"):out.index("--reward-weights") + 2]
    del out[out.index("format=[0-9]") - 1:out.index("format=[0-9]") + 1]
    return out


def test_a_batch_no_function_scores_stops_the_run_and_an_unscored_completion_is_said(grpo_root, capsys):
    """Every prompt in the first batch: where no function scores any completion the run stops (exit 2, naming the
    prompt) instead of training on zeros; where one prompt's completions alone are unscored, the log says so
    (as TRL warns) and the run goes on. Rewards whose spread overflows float32 stop it too."""
    base = argv(grpo_root, "never", "--strategy", "single", "--steps", "1", "--num-iterations", "1",
                "--grpo-beta", "0", "--batch-size", "32")
    _fails(capsys, main(_only_reward(base, grpo_root, "never")),
           "no completion of the generation batch at step 1 got a reward", "every reward function ('never')",
           "each of its 32 completions", "prompts.jsonl:")
    assert not (grpo_root / "never" / "adapter").exists()
    sometimes = _only_reward(argv(grpo_root, "sometimes", "--strategy", "single", "--steps", "1",
                                  "--num-iterations", "1", "--grpo-beta", "0", "--batch-size", "32"),
                             grpo_root, "sometimes")
    assert main(sometimes) == 0
    err = capsys.readouterr().err
    assert "step 1: 8 of 32 completions got no reward (every function, 'sometimes', answered None)" in err, err
    assert "'Question 0: what is 0+0?'" in err, err
    _fails(capsys, main(_only_reward(argv(grpo_root, "enormous", "--strategy", "single", "--steps", "1"), grpo_root,
                                     "enormous")),
           "the rewards of the generation batch at step 1 overflow float32", "the largest answer is 3e+38")


def test_a_run_whose_every_group_was_rewarded_alike_writes_no_adapter(grpo_root, capsys):
    """format=. matches every completion: each group's rewards are equal at every step and every advantage is 0,
    so the fresh LoRA's B stays exactly 0. The run says it learned nothing and ends 2 without writing an adapter
    that changes nothing; metrics.jsonl keeps its steps. On 2 FSDP2 ranks: each decides from the gathered adapter,
    so both stop alike and none is left waiting."""
    base = _only_reward(argv(grpo_root, "alike", "--strategy", "fsdp2", "--nproc", "2", "--steps", "2",
                             "--num-iterations", "1", "--grpo-beta", "0"), grpo_root, "digits")
    base[base.index(f"{grpo_root / 'rewards.py'}:digits")] = "format=."
    _fails(capsys, main(base), "the run learned nothing in its 2 step(s): every lora_B weight is still exactly 0",
           "every group's completions were rewarded alike at every step", "No adapter was written")
    assert not (grpo_root / "alike" / "adapter").exists()
    assert [m["rewards/format/std"] for m in metrics(grpo_root / "alike")] == [0.0, 0.0]


def test_a_run_from_an_init_adapter_that_learned_nothing_writes_no_adapter(grpo_root, one_rank, capsys):
    """From --init-adapter B is not 0: with every group rewarded alike at every step the adapter would be the one
    given, exactly; the run says so, and that 3 steps in a row had nothing to learn (not a bad --lr), and ends 2."""
    base = _only_reward(argv(grpo_root, "alike-init", "--strategy", "single", "--steps", "3", "--num-iterations",
                             "1", "--grpo-beta", "0", "--init-adapter", str(one_rank / "adapter")), grpo_root, "digits")
    base[base.index(f"{grpo_root / 'rewards.py'}:digits")] = "format=."
    code = main(base)
    err = capsys.readouterr().err
    assert code == 2, err
    assert "the run learned nothing in its 3 step(s): every weight is exactly the one --init-adapter " \
        f"{one_rank / 'adapter'} started from" in err and "No adapter was written" in err, err
    assert "(steps 1-3): these batches had nothing to learn" in err and "a far too large --lr" not in err, err
    assert not (grpo_root / "alike-init" / "adapter").exists()


def test_an_init_adapter_is_the_reference_on_fsdp2_ranks_that_carry_the_generation(grpo_root, one_rank):
    """β > 0 from --init-adapter on 2 FSDP2 ranks whose generation leaves the units gathered for training: the
    reference swaps the initial LoRA weights into the sharded parameters (once crashed on the gathered copies,
    exit 3), so step 1's KL is 0 (policy = reference) and it grows as the adapter moves; as on 1 rank."""
    runs = {}
    for name, spread in (("init-one", ("--strategy", "single")), ("init-two", ("--strategy", "fsdp2", "--nproc", "2"))):
        assert main(argv(grpo_root, name, *spread, "--steps", "2", "--num-iterations", "1",
                         "--init-adapter", str(one_rank / "adapter"))) == 0
        runs[name] = metrics(grpo_root / name)
    for rows in runs.values():
        assert rows[0]["kl"] == 0.0 and rows[1]["kl"] > 0
    torch.testing.assert_close(torch.tensor([r["loss"] for r in runs["init-two"]], dtype=torch.float64),
                               torch.tensor([r["loss"] for r in runs["init-one"]], dtype=torch.float64),
                               rtol=1e-5, atol=1e-6)


def test_the_planner_counts_generation(grpo_root, capsys):
    """`shardtune plan` adds generation's moment: a KV cache for every completion a rank samples at once."""
    def kv_cache(batch: int) -> dict:
        code = main(["plan", *argv(grpo_root, "plan")[1:], "--batch-size", str(batch), "--max-completion-length",
                     "256", "--nproc", "2", "--strategy", "fsdp2", "--micro-batch-size", "1", "--json"])
        assert code == 0
        return json.loads(capsys.readouterr().out)["fsdp2"]

    small, large = kv_cache(64), kv_cache(1024)
    assert large["peak_at"] == "generation (KV cache)"
    assert large["terms"]["kv_cache"] == pytest.approx(16 * small["terms"]["kv_cache"], rel=1e-3)  # rounded to kB
    assert large["terms"]["grads"] == 0  # generation comes before the step's backward
    # on CPU, fsdp2's gather buffers shared by a host's ranks are kept for the run: generation gathers through them
    assert large["terms"]["buffers"] > 0 and large["terms"]["buffers"] == small["terms"]["buffers"]


def test_generation_gathers_no_layer_where_the_gathered_model_does_not_fit(grpo_root, capsys):
    """Under fsdp2 on 2 ranks the tiny model's layers are kept gathered for the generation where they fit (too
    small for the exchange to pay); just below that, generation computes from the row shards instead of
    gathering per token: its predicted peak counts no gathered layer. DoRA, which reads its base weight whole,
    gathers per token there."""
    from shardtune.runtime.memory import MB

    def plan(budget: str, *extra: str) -> dict:
        code = main(["plan", *argv(grpo_root, "plan")[1:], "--batch-size", "1024", "--max-completion-length", "256",
                     "--nproc", "2", "--strategy", "fsdp2", "--fsdp-unit", "layer", "--micro-batch-size", "1",
                     "--memory-per-rank", budget, "--json", *extra])
        assert code == 0
        return json.loads(capsys.readouterr().out)

    kept = plan("1TiB")
    assert kept["run_plan"]["generation_gathered"] is True and not kept["run_plan"]["generation_exchanged"]
    # kept gathered, the frozen shards are freed: on this tiny model the two peaks lie a few KB apart
    below = f"{int((kept['fsdp2']['peak_mb'] - 0.005) * MB)}B"
    exchanged, dora = plan(below), plan(below, "--lora-variant", "dora")
    assert exchanged["run_plan"]["generation_exchanged"] is True and not exchanged["run_plan"]["generation_gathered"]
    assert not dora["run_plan"]["generation_exchanged"] and not dora["run_plan"]["generation_gathered"]
    assert exchanged["fsdp2"]["terms"]["blocks"] < dora["fsdp2"]["terms"]["blocks"] < kept["fsdp2"]["terms"]["blocks"]


def test_generation_computes_from_row_shards_where_that_pays(grpo_root, capsys, monkeypatch):
    """Layers large enough that reading 1/N of them per token outweighs the exchange's collectives
    (``EXCHANGE_PAYS_FROM``, here lowered to the tiny model's) are never gathered for the generation, even where
    they would fit; DoRA keeps them gathered."""
    from shardtune.train import choice

    monkeypatch.setitem(choice.EXCHANGE_PAYS_FROM, "cpu", 1)

    def plan(*extra: str) -> dict:
        code = main(["plan", *argv(grpo_root, "plan")[1:], "--nproc", "2", "--strategy", "fsdp2",
                     "--micro-batch-size", "1", "--memory-per-rank", "1TiB", "--json", *extra])
        assert code == 0
        return json.loads(capsys.readouterr().out)["run_plan"]

    exchanged, dora = plan(), plan("--lora-variant", "dora")
    assert exchanged["generation_exchanged"] is True and exchanged["generation_gathered"] is False
    assert dora["generation_exchanged"] is False and dora["generation_gathered"] is True


def test_every_rank_samples_all_rows_where_the_kv_cache_it_reads_is_small_and_fits(grpo_root, capsys, monkeypatch):
    """Exchanged, every rank samples all of its shard group's rows where the other ranks' KV cache it then reads per
    layer stays within ``REPLICATED_READS_UP_TO`` and the predicted peak, which holds every row's KV cache, fits;
    else each rank samples its own rows."""
    from shardtune.runtime.memory import MB
    from shardtune.train import choice

    monkeypatch.setitem(choice.EXCHANGE_PAYS_FROM, "cpu", 1)

    def plan(budget: str = "1TiB") -> dict:
        code = main(["plan", *argv(grpo_root, "plan")[1:], "--batch-size", "256", "--max-completion-length", "256",
                     "--nproc", "2", "--strategy", "fsdp2", "--micro-batch-size", "1", "--memory-per-rank", budget,
                     "--json"])
        assert code == 0
        return json.loads(capsys.readouterr().out)

    replicated = plan()
    monkeypatch.setitem(choice.REPLICATED_READS_UP_TO, "cpu", 0)
    own = plan()
    monkeypatch.undo()
    monkeypatch.setitem(choice.EXCHANGE_PAYS_FROM, "cpu", 1)
    below = plan(f"{int((replicated['fsdp2']['peak_mb'] - 0.05) * MB)}B")
    assert replicated["run_plan"]["generation_replicated"] is True
    assert not own["run_plan"]["generation_replicated"] and not below["run_plan"]["generation_replicated"]
    for p in (replicated, own, below):
        assert p["run_plan"]["generation_exchanged"] and p["fsdp2"]["peak_at"] == "generation (KV cache)"
    # both ranks' rows: twice the KV cache of a rank's own
    assert replicated["fsdp2"]["terms"]["kv_cache"] == pytest.approx(2 * own["fsdp2"]["terms"]["kv_cache"], rel=1e-3)
    assert below["fsdp2"]["peak_mb"] == own["fsdp2"]["peak_mb"] < replicated["fsdp2"]["peak_mb"]


def test_training_computes_from_row_shards_where_a_step_moves_fewer_bytes(grpo_root, capsys, monkeypatch, tmp_path):
    """Where generation computes from the row shards, training does too when a micro-batch's inputs and outputs
    of the projections weigh less than a layer (``EXCHANGED_HIDDENS``): not the tiny model's small layers at
    first; with the activations counted as nothing, it does, and its predicted peak then holds no gathered
    projection. A 4-bit base does too, its layers counted at their dequantized size."""
    from shardtune.train import choice

    monkeypatch.setitem(choice.EXCHANGE_PAYS_FROM, "cpu", 1)

    def plan(*extra: str) -> dict:
        code = main(["plan", *argv(grpo_root, "plan")[1:], "--nproc", "2", "--strategy", "fsdp2",
                     "--micro-batch-size", "1", "--memory-per-rank", "1TiB", "--json", *extra])
        assert code == 0
        return json.loads(capsys.readouterr().out)

    generation_only = plan()
    monkeypatch.setattr(choice, "EXCHANGED_HIDDENS", 0)
    training_too, four_bit = plan(), plan("--quantize", "nf4")
    assert generation_only["run_plan"]["generation_exchanged"] and not generation_only["run_plan"]["layers_exchanged"]
    assert training_too["run_plan"]["generation_exchanged"] and training_too["run_plan"]["layers_exchanged"]
    assert four_bit["run_plan"]["generation_exchanged"] and four_bit["run_plan"]["layers_exchanged"]
    # the step's own moments (as for a run whose completions a vLLM server samples), on layers wide beside LoRA
    from shardtune.config import build_config
    from shardtune.train.choice import Search

    wide = make_model(tmp_path / "wide", hidden=256)
    search = Search(build_config({"model": str(wide), "data": str(grpo_root / "prompts.jsonl"),
                                  "objective": "grpo", "seq-len": 48, "dtype": "fp32", "nproc": 2}))
    setting = dataclasses.replace(search.setting("fsdp2", 2, 4), activation_checkpointing=True,
                                  generation_rows=0, generation_exchanged=True)
    gathered, exchanged = (search.predict(dataclasses.replace(setting, layers_exchanged=on)) for on in (False, True))
    assert gathered.moment == exchanged.moment == "backward through the layers"
    assert exchanged.terms["blocks"] < gathered.terms["blocks"] / 4
    assert exchanged.terms["activations"] > gathered.terms["activations"]  # the exchange's buffers


def test_generation_keeps_the_weights_gathered_only_where_they_fit(grpo_root, capsys):
    """Where generation cannot compute from the row shards (DoRA) the run plan keeps the weights gathered for a
    whole generation (no gather per token) when the predicted peak with them fits --memory-per-rank; just below
    it, generation gathers per token again, and the prediction counts only one unit's gathered copy."""
    from shardtune.runtime.memory import MB

    def plan(budget: str) -> dict:
        code = main(["plan", *argv(grpo_root, "plan")[1:], "--batch-size", "1024", "--max-completion-length", "256",
                     "--nproc", "2", "--strategy", "fsdp2", "--micro-batch-size", "1", "--memory-per-rank", budget,
                     "--json", "--lora-variant", "dora"])
        assert code == 0
        return json.loads(capsys.readouterr().out)

    kept = plan("1TiB")
    assert kept["run_plan"]["generation_gathered"] is True and kept["fsdp2"]["peak_at"] == "generation (KV cache)"
    tight = plan(f"{int((kept['fsdp2']['peak_mb'] - 0.05) * MB)}B")
    assert tight["run_plan"]["generation_gathered"] is False
    assert tight["fsdp2"]["terms"]["blocks"] < kept["fsdp2"]["terms"]["blocks"]
    assert tight["fsdp2"]["peak_mb"] < kept["fsdp2"]["peak_mb"] - 0.05


def test_generation_keeps_the_weights_gathered_into_training_only_where_that_fits(grpo_root, tmp_path, capsys,
                                                                                  caplog):
    """Kept gathered, the weights stay so into the step's training (its forward and backward gather none) when the
    training's predicted peak with the whole model held fits --memory-per-rank, and the log line says so; just
    below it they are kept for the generation only, and the prediction counts the whole model in no training
    moment (on a model whose layers outweigh the rounding)."""
    from shardtune.runtime.memory import MB

    wide = make_model(tmp_path / "wide", "llama", hidden=512)

    def plan(budget: str) -> tuple[dict, str]:
        caplog.clear()
        args = ["plan", *argv(grpo_root, "plan")[1:], "--nproc", "2", "--strategy", "fsdp2", "--fsdp-unit", "part",
                "--micro-batch-size", "4", "--memory-per-rank", budget, "--json"]
        args[args.index("--model") + 1] = str(wide)
        with caplog.at_level(logging.INFO, logger="shardtune"):
            code = main(args)
        assert code == 0
        return json.loads(capsys.readouterr().out), caplog.text

    held, said = plan("1TiB")
    assert held["run_plan"]["generation_gathered"] is True and held["run_plan"]["generation_carried"] is True
    assert held["fsdp2"]["peak_at"].endswith(", the generation's weights held"), held["fsdp2"]["peak_at"]
    assert "generation keeps the weights gathered, and the training step after it too" in said, said
    kept, said = plan(f"{int((held['fsdp2']['peak_mb'] - 0.05) * MB)}B")
    assert kept["run_plan"]["generation_gathered"] is True and kept["run_plan"]["generation_carried"] is False
    assert "the training step after it" not in said, said
    assert not kept["fsdp2"]["peak_at"].endswith("held") and kept["fsdp2"]["peak_mb"] < held["fsdp2"]["peak_mb"]
    assert kept["fsdp2"]["terms"]["blocks"] < held["fsdp2"]["terms"]["blocks"]


def test_a_4bit_base_is_dequantized_once_per_generation_only_where_it_fits(grpo_root, capsys):
    """--quantize nf4: the run plan keeps the weights gathered and dequantizes each 4-bit weight once per
    generation (not in every token's forward) when the peak with all of them in the compute dtype fits; just
    below it, generation computes from the row shards instead, each rank's rows dequantized once (kept gathered,
    every token's forward would dequantize every layer whole); below that, the rows stay 4-bit, and the
    prediction counts no dequantized weight. Where the exchange's buffers do not fit (a narrower model) or the
    rows cannot be exchanged (DoRA), the weights stay gathered in 4-bit."""
    from shardtune.runtime.memory import MB

    from tiny import make_model

    # NF4's blocks divide both widths; at 512 the dequantized weights outweigh the exchange's buffers
    wide, narrow = (make_model(grpo_root / f"model-{h}-plan", "llama", hidden=h, row_scales=True) for h in (512, 256))

    def plan(model: Path, budget: str | dict, *extra: str) -> dict:
        args = argv(grpo_root, "plan")[1:]
        args[args.index("--model") + 1] = str(model)
        if isinstance(budget, dict):  # just below that plan's peak
            budget = f"{int((budget['fsdp2']['peak_mb'] - 0.05) * MB)}B"
        code = main(["plan", *args, "--quantize", "nf4", "--nproc", "2", "--strategy", "fsdp2",
                     "--micro-batch-size", "1", "--memory-per-rank", budget, "--json", *extra])
        assert code == 0
        return json.loads(capsys.readouterr().out)

    def generation(run: dict) -> tuple[bool, bool, bool]:
        return tuple(run["run_plan"][f"generation_{how}"] for how in ("gathered", "exchanged", "dequantized"))

    once = plan(wide, "1TiB")
    assert generation(once) == (True, False, True) and once["fsdp2"]["peak_at"] == "generation (KV cache)"
    assert once["fsdp2"]["terms"]["dequant"] > 0.05
    rows = plan(wide, once)
    assert generation(rows) == (False, True, True)
    assert 0.05 < rows["fsdp2"]["terms"]["dequant"] < once["fsdp2"]["terms"]["dequant"]
    assert rows["fsdp2"]["peak_mb"] < once["fsdp2"]["peak_mb"] - 0.05
    tight = plan(wide, rows)
    assert generation(tight) == (False, True, False) and tight["fsdp2"]["peak_mb"] < rows["fsdp2"]["peak_mb"] - 0.05

    run = plan(narrow, plan(narrow, "1TiB"))
    assert generation(run)[:2] == (False, True)
    for _ in range(8):  # each budget just below the last plan's peak, until no exchanged generation fits
        run = plan(narrow, run)
        if not generation(run)[1]:
            break
    assert generation(run) == (True, False, False) and run["fsdp2"]["fits"]
    # DoRA, in one unit layout (another's buffers may fit the dequantized weights a little lower): just below the
    # dequantized generation's peak, they stay 4-bit, gathered
    dora_once = plan(wide, "1TiB", "--lora-variant", "dora", "--fsdp-unit", "layer")
    assert generation(dora_once) == (True, False, True) and dora_once["fsdp2"]["peak_at"] == "generation (KV cache)"
    dora = plan(wide, dora_once, "--lora-variant", "dora", "--fsdp-unit", "layer")
    assert generation(dora) == (True, False, False)
    assert dora["fsdp2"]["terms"]["dequant"] < dora_once["fsdp2"]["terms"]["dequant"] / 2


def test_steps_with_nothing_to_learn_are_no_divergence_under_ddp(grpo_root):
    """After the first step every completion is rewarded alike: every advantage is 0, and so is the gradient,
    right after a step whose gradient was not; the divergence guard must not take that for blown-up weights.
    On 2 DDP ranks, which generate each on its own (no collective per token)."""
    code = main(["finetune", "--model", str(grpo_root / "model"), "--data", str(grpo_root / "prompts.jsonl"),
                 "--out", str(grpo_root / "flat"), "--objective", "grpo",
                 "--reward", f"{grpo_root / 'rewards.py'}:first_step_only",
                 "--num-generations", "2", "--batch-size", "4", "--max-completion-length", "6", "--seq-len", "48",
                 "--steps", "3", "--dtype", "fp32", "--strategy", "ddp", "--nproc", "2"])
    assert code == 0
    rows = metrics(grpo_root / "flat")
    assert rows[0]["grad_norm"] > 0 and rows[0]["frac_reward_zero_std"] == 0.0
    assert [(m["grad_norm"], m["frac_reward_zero_std"], m["loss"]) for m in rows[1:]] == [(0.0, 1.0, 0.0)] * 2


@pytest.mark.parametrize("strategy", ["fsdp2", "ddp"])
def test_sigterm_while_generating_stops_at_once_keeping_the_last_step(grpo_root, strategy):
    """SIGTERM to the launcher while a step generates (long completions): the generation ends at the next token
    on every rank (FSDP2: in lockstep, every forward a collective; DDP: each rank alone, agreeing after), the
    step is not done (no metrics line, no checkpoint of it), the last finished step's checkpoint is written and
    the stop message names it, exit 128 + SIGTERM; once (DDP's run saves every step: not again)."""
    import signal
    import subprocess
    import time

    from shardtune.train.checkpoint_files import find_latest

    out = grpo_root / f"sigterm-{strategy}"
    args = argv(grpo_root, out.name, "--strategy", "fsdp2" if strategy == "fsdp2" else "ddp", "--nproc", "2",
                "--steps", "1000", "--num-iterations", "1", "--max-completion-length", "300",
                "--save-every", "1" if strategy == "ddp" else "1000")
    proc = subprocess.Popen(cli_process.command(args), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics_file, deadline = out / "metrics.jsonl", time.monotonic() + 300
    while not (metrics_file.is_file() and metrics_file.read_text().strip()):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the run ended or stalled before step 1:\n{proc.communicate()[0][-3000:]}")
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)  # step 2 is generating its 300 tokens a row
    output = proc.communicate(timeout=120)[0]
    assert proc.returncode == 128 + signal.SIGTERM, output[-3000:]
    assert [m["step"] for m in metrics(out)] == [1], output[-3000:]
    latest = find_latest(out)
    assert latest is not None and latest.name == "step-1", output[-3000:]
    assert f"stopped by SIGTERM; the newest complete checkpoint is {latest}" in output
    assert output.count(f"checkpoint {latest} written") == 1, output[-3000:]


def test_reward_functions_given_as_python_functions_train_as_their_specs(grpo_root, one_rank, monkeypatch):
    """The Python API takes reward functions as objects (``reward=[fn]``, as TRL's ``reward_funcs``): a function of
    a module's file is named for the workers by that file and trains as ``--reward FILE:NAME`` does (the first
    generation batch's rewards, the first step's loss, the same completions); one of a package imported from
    the caller's own ``sys.path`` (a notebook's ``sys.path.append``) reaches the workers as well."""
    import importlib.util
    import os
    import sys

    import shardtune

    loader = importlib.util.spec_from_file_location("grpo_api_rewards", grpo_root / "rewards.py")
    module = importlib.util.module_from_spec(loader)
    monkeypatch.setitem(sys.modules, "grpo_api_rewards", module)  # imported, as a user's module is
    loader.loader.exec_module(module)
    args = argv(grpo_root, "api", "--strategy", "single", "--steps", "2")[1:]
    options: dict = {}
    for flag, value in zip(args[::2], args[1::2]):
        key = flag.removeprefix("--")
        options[key] = [*options.get(key, []), value] if key == "reward" else value
    # ``format`` from a package a notebook imported from its own sys.path: the workers get its folder
    source = grpo_root / "notebook-src" / "api_scores"
    source.mkdir(parents=True, exist_ok=True)
    (source / "__init__.py").write_text("")
    (source / "regex.py").write_text("import re\n\n\ndef format(prompts, completions, **fields):\n"
                                     "    return [float(re.search('[0-9]', c) is not None) for c in completions]\n")
    monkeypatch.syspath_prepend(str(source.parent))
    from api_scores import regex
    before = os.environ.get("PYTHONPATH")
    options["reward"] = [module.digits, regex.format]
    shardtune.finetune(options)
    assert os.environ.get("PYTHONPATH") == before  # set for the workers only
    api, cli = metrics(grpo_root / "api"), metrics(one_rank)[:2]
    assert [m["rewards/digits/mean"] for m in api] == [m["rewards/digits/mean"] for m in cli]
    assert [m["reward"] for m in api] == [m["reward"] for m in cli] and api[0]["loss"] == cli[0]["loss"]
    assert [c["completion"] for c in completions(grpo_root / "api")] == \
        [c["completion"] for c in completions(one_rank) if c["step"] == 1]


def test_reward_functions_the_workers_cannot_load_by_name_are_refused_before_they_start(grpo_root, no_workers,
                                                                                         monkeypatch):
    """A lambda, a function defined inside another, a ``functools.partial`` and one defined in the notebook or
    script that runs (``__main__``) cannot reach the fresh worker processes: each is refused before they start,
    naming it and saying what to do."""
    import functools
    import sys

    import shardtune
    from shardtune.train.rewards import RewardError

    def inner(prompts, completions, **fields):
        return [0.0] * len(completions)
    notebook: dict = {"__name__": "__main__"}
    exec("def in_a_cell(prompts, completions, **fields):\n    return [0.0] * len(completions)\n", notebook)
    monkeypatch.setattr(sys.modules["__main__"], "in_a_cell", notebook["in_a_cell"], raising=False)
    options = {"model": str(grpo_root / "model"), "data": str(grpo_root / "prompts.jsonl"),
               "out": str(grpo_root / "refused-api"), "objective": "grpo"}
    for reward, said in [(lambda prompts, completions, **f: [0.0], "<lambda>: not a module-level function"),
                         (inner, "inner: not a module-level function"),
                         (functools.partial(inner), "a partial, not a function"),
                         (notebook["in_a_cell"], "in_a_cell: defined in a notebook or the script that runs")]:
        with pytest.raises(RewardError, match="put it in a .py file") as err:
            shardtune.finetune({**options, "reward": [reward]})
        assert said in str(err.value), str(err.value)
    assert not (grpo_root / "refused-api").exists()


def test_eval_reward_scores_base_and_adapter_completions(grpo_root, one_rank, capsys):
    """`shardtune eval --reward`: greedy completions of held-out prompts, scored by the reward functions, for the
    base (the adapter switched off) and base + adapter."""
    def evaluate(*extra: str) -> dict:
        code = main(["eval", "--model", str(grpo_root / "model"), "--data", str(grpo_root / "prompts.jsonl"),
                     "--reward", f"{grpo_root / 'rewards.py'}:digits", "--reward", "format=[0-9]",
                     "--reward-weights", "1,0.5", "--max-new-tokens", "6", "--json", *extra])
        assert code == 0
        return json.loads(capsys.readouterr().out)

    both = evaluate("--adapter", str(one_rank / "adapter"), "--out", str(grpo_root / "eval.json"))
    base = evaluate()
    assert both["prompts"] == base["prompts"] == len(prompt_records())
    assert both["base"] == base["base"]  # the adapter switched off is the base
    tuned = both["adapter_figures"]
    assert {"reward", "rewards/digits/mean", "rewards/format/mean", "completions/clipped_ratio"} <= set(tuned)
    assert tuned["reward"] == pytest.approx(tuned["rewards/digits/mean"] + 0.5 * tuned["rewards/format/mean"])
    assert tuned["samples"] != both["base"]["samples"]  # the adapter's completions differ from the base's
    assert json.loads((grpo_root / "eval.json").read_text()) == both
    # beside a run's adapter: written to its eval.json and sent to its trackers at its last step
    run = grpo_root / "reported"
    shutil.copytree(one_rank, run)
    reported = evaluate("--adapter", str(run / "adapter"), "--report-to", "tensorboard")
    assert reported["adapter_figures"] == tuned and json.loads((run / "eval.json").read_text()) == reported
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    [event] = events.Scalars("eval/adapter/prompts/reward")
    assert event.step == 4 and event.value == pytest.approx(tuned["reward"])
    assert events.Scalars("eval/base/prompts/rewards/digits/mean")[0].value == \
        pytest.approx(both["base"]["rewards/digits/mean"])
    assert main(["report", str(run)]) == 0  # shown as what it is, not as preference pairs
    md = (run / "report.md").read_text()
    assert "## Reward evaluation on" in md and "(8 prompts, `shardtune eval --reward`)" in md
    assert "| rewards/digits/mean |" in md and "Preference evaluation" not in md
    # a reward that applies to no held-out prompt measures nothing: exit 2, not a table of dashes
    _fails(capsys, main(["eval", "--model", str(grpo_root / "model"), "--data", str(grpo_root / "prompts.jsonl"),
                         "--reward", f"{grpo_root / 'rewards.py'}:never", "--max-new-tokens", "2"]),
           "no completion of the held-out prompts got a reward", "prompts.jsonl:1: 'Question 0: what is 0+0?'")



def test_eval_reward_refuses_what_finetune_refuses(grpo_root, capsys):
    """`shardtune eval --reward` takes the rules finetune's rewards and numbers follow, exit 2 naming the option:
    no reward of Infinity printed with exit 0, no prompt cut by a negative --seq-len, no range() of step 0."""
    def eval_(*extra: str) -> int:
        return main(["eval", "--model", str(grpo_root / "model"), "--data", str(grpo_root / "prompts.jsonl"),
                     "--reward", f"{grpo_root / 'rewards.py'}:digits", "--max-new-tokens", "2", *extra])

    _fails(capsys, eval_("--reward-weights", "1e39"), "the rewards of the held-out prompts overflow float32",
           "weights 1e+39")
    _fails(capsys, eval_("--reward-weights", "0"), "option 'reward-weights' (0) weighs every --reward 0")
    _fails(capsys, eval_("--reward-weights", "1,1"), "option 'reward-weights' has 2 weights for 1 --reward")
    _fails(capsys, eval_("--max-new-tokens", "0"), "option 'max-new-tokens' (0) must be at least 1 with --reward")
    for flag, value, said in (("--seq-len", "-5", "must be at least 1, got -5"),
                              ("--batch-size", "0", "must be at least 1, got 0"),
                              ("--temperature", "nan", "must be a finite number at least 0, got nan")):
        with pytest.raises(SystemExit) as exit_:
            eval_(flag, value)
        assert exit_.value.code == 2
        assert f"argument {flag}: {said}" in capsys.readouterr().err


def test_sequences_past_a_learned_position_table_are_refused_or_cut_not_crashed(grpo_root, capsys, caplog,
                                                                                  no_workers, tmp_path):
    """GPT-2 learned a table of 256 positions and has none beyond: a fine-tune or eval whose rows would be longer
    stops before any worker with exit 2 naming the options (not an IndexError deep in torch); eval --reward, as
    generate, cuts completions at the context's end."""
    from tiny import make_model

    gpt2 = make_model(tmp_path / "gpt2", "gpt2")
    model = ["--model", str(gpt2)]
    grpo = [*argv(grpo_root, "long")[argv(grpo_root, "long").index("--data"):], "--strategy", "single", "--steps", "1"]
    grpo[grpo.index("--max-completion-length") + 1] = "300"
    _fails(capsys, main(["finetune", *model, *grpo]), "--seq-len 48 + --max-completion-length 300 makes sequences "
           "of up to 348 tokens", "has learned positions for 256 tokens")
    write_jsonl(tmp_path / "text.jsonl", [{"text": "some words " * 20}] * 4)
    for command in (["finetune", "--out", str(tmp_path / "sft")], ["eval"]):
        _fails(capsys, main([*command, *model, "--data", str(tmp_path / "text.jsonl"), "--seq-len", "300"]),
               "--seq-len 300 makes sequences of up to 300 tokens")
    code = main(["eval", *model, "--data", str(grpo_root / "prompts.jsonl"), "--reward",
                 f"{grpo_root / 'rewards.py'}:digits", "--max-new-tokens", "300", "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "the answer would run past the model's context of 256 tokens" in caplog.text
    assert json.loads(captured.out)["base"]["completions/clipped_ratio"] > 0


def test_other_objectives_records_as_prompts_are_said_to_be_fields_only(grpo_root, caplog, capsys, monkeypatch,
                                                                        tmp_path):
    """An SFT file (instruction, input, output) or preference pairs given as GRPO's prompts run, but say that their
    responses only reach the reward functions as fields, and that an SFT 'input' is no part of the prompt."""
    import shardtune.launch

    launched: list = []
    monkeypatch.setattr(shardtune.launch, "launch", lambda cfg, plan, asked=None: launched.append(cfg) or {})
    sft = write_jsonl(tmp_path / "sft.jsonl", [{"instruction": f"Add {i} and {i}", "input": f"{i} {i}",
                                                "output": str(2 * i)} for i in range(4)])
    pairs = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": f"say {i}", "chosen": str(i), "rejected": "no"}
                                                   for i in range(4)])
    for data, said in ((sft, ["4 of 4 records have 'output' (record 1, 2, 3, 4), an SFT record's field",
                              "4 of 4 records have an 'input' beside their 'instruction'"]),
                       (pairs, ["4 of 4 records have 'chosen' (record 1, 2, 3, 4), a preference pair's field",
                                "to train on it: --objective dpo, orpo or simpo"])):
        caplog.clear()
        args = argv(grpo_root, f"as-prompts-{data.stem}", "--strategy", "single", "--steps", "1")
        args[args.index("--data") + 1] = str(data)
        args[args.index("--reward") + 1] = "exact_match=rejected" if data == pairs else "exact_match=output"
        assert main(args) == 0, capsys.readouterr().err
        for text in said:
            assert text in caplog.text
    assert len(launched) == 2
    caplog.clear()
    assert main(["eval", "--model", str(grpo_root / "model"), "--data", str(sft), "--reward", "exact_match=output",
                 "--max-new-tokens", "2", "--json"]) == 0
    assert "an SFT record's field" in caplog.text
