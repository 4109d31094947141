"""GRPO with a vLLM generator (``--vllm-url``), as a user starts it (``shardtune finetune``), against the stub
server of tests/vllm_stub.py: before each generation batch the adapter alone is written and loaded as the
version of that optimizer step, checked served, and the policy trains on the server's completions; a server
that does not take a new version stops the run; an unreachable server, one without runtime LoRA, or an adapter
vLLM cannot load are refused before any worker starts. With TRL's vLLM importance-sampling correction (on by
default) the server reports each sampled token's log-prob, and the loss is reweighted by the trainer's over the
server's probabilities as the mode says; off-policy masking measures the trainer against them too."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from shardtune.cli import main

from tiny import write_jsonl
from vllm_stub import Stub, serve

G = 4
REWARDS = '''
def digits(prompts, completions, **fields):
    return [float(sum(ch.isdigit() for ch in c)) for c in completions]
'''
# The server's completion j of every prompt: three that stop at EOS (257, kept), one cut at the length limit.
TEXTS = ("7", "ab", "123")
LIMIT = 6


@pytest.fixture(scope="module")
def vllm_root(tmp_path_factory, tiny_llama) -> Path:
    root = tmp_path_factory.mktemp("grpo-vllm")
    write_jsonl(root / "prompts.jsonl", [{"prompt": f"Question {i}: what is {i}+{i}?"} for i in range(6)])
    (root / "rewards.py").write_text(REWARDS)
    (root / "model").symlink_to(tiny_llama, target_is_directory=True)
    return root


def server_completion(tokenizer):
    def complete(prompt: list[int], j: int, max_tokens: int) -> tuple[list[int], str]:
        if j < len(TEXTS):
            return tokenizer.encode(TEXTS[j], add_special_tokens=False) + [257], "stop"
        return tokenizer.encode("9" * max_tokens, add_special_tokens=False)[:max_tokens], "length"
    return complete


def argv(root: Path, out: str, url: str, *extra: str) -> list[str]:
    return ["finetune", "--model", str(root / "model"), "--data", str(root / "prompts.jsonl"), "--out",
            str(root / out), "--objective", "grpo", "--reward", f"{root / 'rewards.py'}:digits", "--num-generations",
            str(G), "--batch-size", "8", "--max-completion-length", str(LIMIT), "--seq-len", "48", "--dtype", "fp32",
            "--lr", "3e-2", "--warmup-steps", "0", "--seed", "3", "--vllm-url", url, *extra]


def test_rollouts_come_from_the_server_synced_with_each_steps_adapter(vllm_root):
    """2 FSDP2 ranks, 3 steps of one iteration: versions 0, 1, 2 loaded (each from its own folder, only the LoRA
    tensors), each checked before the completions of its batch are asked of it; the previous one unloaded."""
    from transformers import AutoTokenizer

    stub = Stub(complete=server_completion(AutoTokenizer.from_pretrained(vllm_root / "model")))
    out = vllm_root / "run"
    with serve(stub) as url:
        code = main(argv(vllm_root, "run", url, "--strategy", "fsdp2", "--nproc", "2", "--steps", "3",
                         "--micro-batch-size", "2", "--temperature", "0.9", "--top-p", "0.95", "--top-k", "50"))
    assert code == 0
    loads = stub.loads()
    assert [name.rsplit("-", 1)[1] for name in loads] == ["v0", "v1", "v2"]
    assert len({name.rsplit("-", 1)[0] for name in loads}) == 1
    assert list(stub.adapters) == [loads[-1]]  # the earlier versions unloaded
    assert stub.adapters[loads[-1]] == str((out / "generator" / "v2").resolve())
    assert sorted(p.name for p in (out / "generator").iterdir()) == ["v2"]  # older folders removed
    # each version is the adapter as the steps left it: the first the initial one (B = 0), then changed each step
    final = load_file(out / "adapter" / "adapter_model.safetensors")
    v0, v1, v2 = (stub.weights[name] for name in loads)
    assert set(v0) == set(v1) == set(v2) == set(final)
    assert all(not v0[k].any() for k in v0 if "lora_B" in k)
    for before, after in ((v0, v1), (v1, v2), (v2, final)):
        assert any(not torch.equal(before[k], after[k]) for k in before)
    # every batch asked of the version synced for it, with the run's sampling options
    asked = stub.asked()
    assert [a["model"] for a in asked] == loads
    for a in asked:
        assert (a["n"], a["max_tokens"], a["temperature"], a["top_p"], a["top_k"], a["stop_token_ids"]) == \
            (G, LIMIT, 0.9, 0.95, 50, [257])
        assert len(a["prompt"]) == 2 and all(isinstance(t, int) for p in a["prompt"] for t in p)
        assert a["logprobs"] == 0  # the sampled tokens' own log-probs, for the importance-sampling correction
    # and training consumed the server's completions
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3
    for m in rows:
        assert m["completions/mean_length"] == pytest.approx((2 + 3 + 4 + LIMIT) / 4)  # EOS counted, as TRL
        assert m["completions/clipped_ratio"] == pytest.approx(0.25)
        assert m["reward"] == pytest.approx((1 + 0 + 3 + LIMIT) / 4)
        # the default correction, sequence_mask with C_max 3: a sequence ratio above 3 is masked to 0
        assert 0 <= m["sampling/importance_sampling_ratio/min"] <= m["sampling/importance_sampling_ratio/max"] <= 3
        assert m["sampling/importance_sampling_ratio/max"] > 0
        assert m["sampling/sampling_logp_difference/max"] > 0
    samples = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    assert [s["completion"] for s in samples if s["step"] == 1] == [*TEXTS, "9" * LIMIT]
    assert [s["truncated"] for s in samples if s["step"] == 1] == [False, False, False, True]


IS_METRICS = ("sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max",
              "sampling/importance_sampling_ratio/min", "sampling/importance_sampling_ratio/mean",
              "sampling/importance_sampling_ratio/max")
SHIFT = 1.5  # what the server's log-prob of an odd completion's first token lacks of the trainer's: ratio e^1.5


def trainer_logprobs(root: Path, tokenizer, shift: float):
    """The server's log-probs: those of the trainer's first step (the base model: the new adapter's B is 0) at
    the sampling temperature, each odd completion's first token lowered by ``shift``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(root / "model", dtype=torch.float32).eval()
    odd = {tuple(server_completion(tokenizer)([0], j, LIMIT)[0]) for j in (1, 3)}

    def logprobs(prompt: list[int], ids: list[int]) -> list[float]:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1].float()
        values = torch.log_softmax(logits / 0.9, -1).gather(1, torch.tensor(ids).unsqueeze(1)).squeeze(1)
        if tuple(ids) in odd:
            values[0] -= shift
        return values.tolist()
    return logprobs


def test_the_loss_is_reweighted_by_the_trainers_over_the_servers_probabilities(vllm_root):
    """One step on one rank, dapo (one mean over the batch's 2 x 15 tokens), β = 0: each token's loss is −A·ρ.
    With the server's log-probs equal to the trainer's, ρ = 1 and the run is the run without the correction; with
    an odd completion's first token e^1.5 > --vllm-importance-sampling-max 3 more likely to the trainer, ρ there
    (token modes) or on that whole completion (sequence modes, the tokens' log-ratios summed) is masked to 0 or
    truncated to 3."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(vllm_root / "model")

    def run(name: str, shift: float, *extra: str) -> tuple[dict, list[float]]:
        stub = Stub(complete=server_completion(tokenizer), logprobs=trainer_logprobs(vllm_root, tokenizer, shift))
        with serve(stub) as url:
            code = main(argv(vllm_root, name, url, "--steps", "1", "--strategy", "single", "--temperature", "0.9",
                             "--lora-dropout", "0", *extra))
        assert code == 0
        out = vllm_root / name
        [metrics] = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        samples = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
        return metrics, [s["advantage"] for s in samples]  # group 0's; group 1's completions are the same

    off, adv = run("is-off", 0.0, "--vllm-importance-sampling", "off")
    assert not any(name in off for name in IS_METRICS)
    lengths, odd = [2, 3, 4, LIMIT], [0, 1, 0, 1]

    def expected(weights: list[float]) -> float:  # −Σ A·Σ_t ρ / tokens, for one group (the other is the same)
        return -sum(a * w for a, w in zip(adv, weights)) / sum(lengths)

    assert off["loss"] == pytest.approx(expected(lengths), rel=1e-5)
    assert abs(off["loss"]) > 0.05

    same, _ = run("is-same", 0.0)  # the default: sequence_mask, C_max 3
    assert same["loss"] == pytest.approx(off["loss"], rel=1e-5)
    assert same["sampling/sampling_logp_difference/max"] < 1e-4
    for name in ("min", "mean", "max"):
        assert same[f"sampling/importance_sampling_ratio/{name}"] == pytest.approx(1.0, abs=1e-4)

    # token_truncate and sequence_mask, and the lower bound, are checked against TRL in test_grpo_oracle.py: each
    # run here starts a worker, so one token and one sequence mode, one masking and one truncating
    cases = {"token_mask": ([n - o for n, o in zip(lengths, odd)], 0.0, 1.0),
             "sequence_truncate": ([n * (1 + 2 * o) for n, o in zip(lengths, odd)], 1.0, 3.0)}
    for mode, (weights, low, high) in cases.items():
        m, _ = run(f"is-{mode}", SHIFT, "--vllm-importance-sampling", mode)
        assert m["loss"] == pytest.approx(expected(weights), rel=1e-4), mode
        assert m["sampling/importance_sampling_ratio/min"] == pytest.approx(low, abs=1e-4), mode
        assert m["sampling/importance_sampling_ratio/max"] == pytest.approx(high, abs=1e-4), mode
        assert m["sampling/sampling_logp_difference/max"] == pytest.approx(SHIFT, abs=1e-4), mode
        assert m["sampling/sampling_logp_difference/mean"] == pytest.approx(2 * SHIFT / sum(lengths), abs=1e-4)

    # Off-policy masking, the correction off: the server's log-probs are asked for all the same, and the mask
    # measures the trainer against them (as TRL's, even with num_iterations 1). vLLM found each odd completion's
    # first token e^1.5 more likely than the trainer: mean log-ratios 1.5 / 3 on "ab" (a negative advantage, and
    # above δ = 0.2: no policy loss) and 1.5 / 6 on the cut one (above δ too, but a positive advantage: kept).
    m, _ = run("off-policy-mask", -SHIFT, "--vllm-importance-sampling", "off", "--off-policy-mask-threshold", "0.2")
    assert adv[1] < 0 < adv[3]
    assert m["loss"] == pytest.approx(expected([2, 0, 4, LIMIT]), rel=1e-4)
    assert not any(name in m for name in IS_METRICS)


def test_a_server_that_keeps_serving_an_older_adapter_stops_the_run(vllm_root, capsys):
    """The second version's load answers success, but the server still lists only the first: the run must stop,
    non-zero, rather than train on completions of an adapter it no longer has; on 2 DDP ranks, where rank 1
    waits for rank 0's answer and gets the failure instead."""
    stub = Stub("stale")
    with serve(stub) as url:
        code = main(argv(vllm_root, "stale", url, "--strategy", "ddp", "--nproc", "2", "--steps", "2"))
    err = capsys.readouterr().err
    assert code != 0, err
    assert "after loading adapter version 1" in err and "rollouts would sample another policy" in err, err
    assert len(stub.asked()) == 1  # the first batch only
    assert not (vllm_root / "stale" / "summary.json").exists()


def test_a_server_that_cannot_serve_the_adapter_is_refused_before_workers_start(vllm_root, capsys, no_workers):
    def refused(*expected: str, url: str = "http://127.0.0.1:9", extra: tuple[str, ...] = ()) -> None:
        code = main(argv(vllm_root, "bad", url, *extra))
        err = capsys.readouterr().err
        assert code == 2, err
        for text in expected:
            assert text in err, err

    refused("option 'vllm-url'", "http://127.0.0.1:9", "failed", "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True")
    with serve(Stub("no-runtime-lora")) as url:
        refused("option 'vllm-url'", url, "answered 404", "--enable-lora", url=url)
    refused("option 'vllm-url': 'localhost:8000' is no server address", url="localhost:8000")
    refused("does not take adapters with --lora-variant dora", extra=("--lora-variant", "dora"))
    refused("--lora-modules-to-save", extra=("--lora-modules-to-save", "lm_head"))
    refused("'vllm-importance-sampling-min' (3) must be less than --vllm-importance-sampling-max (3)",
            extra=("--vllm-importance-sampling-min", "3"))
    refused("--grpo-loss vespo", "token_truncate or token_mask", extra=("--grpo-loss", "vespo"))
    local = argv(vllm_root, "bad", "x")[:-2]  # the policy samples itself
    for flag, value in (("--vllm-importance-sampling", "off"), ("--vllm-importance-sampling-max", "2"),
                        ("--vllm-importance-sampling-min", "0.1")):
        assert main([*local, flag, value]) == 2
        assert f"option '{flag[2:]}' applies with --vllm-url only" in capsys.readouterr().err
    sft = ["finetune", "--model", str(vllm_root / "model"), "--data", str(vllm_root / "prompts.jsonl"), "--out",
           str(vllm_root / "bad"), "--vllm-url", "http://127.0.0.1:8000"]
    assert main(sft) == 2
    assert "option 'vllm-url' applies to --objective grpo only" in capsys.readouterr().err


def test_the_planner_counts_no_generation_the_server_does(vllm_root, capsys):
    """`shardtune plan` (which asks no server) leaves out generation's KV cache and gathered weights."""
    def plan(remote: bool) -> dict:
        args = argv(vllm_root, "plan", "http://127.0.0.1:9")[1:]
        code = main(["plan", *(args if remote else args[:-2]), "--batch-size", "1024", "--max-completion-length",
                     "256", "--nproc", "2", "--strategy", "fsdp2", "--micro-batch-size", "1", "--json"])
        assert code == 0
        return json.loads(capsys.readouterr().out)

    here, remote = plan(remote=False), plan(remote=True)
    assert here["fsdp2"]["peak_at"] == "generation (KV cache)" and here["run_plan"]["generation_gathered"] is True
    assert remote["fsdp2"]["peak_at"] != "generation (KV cache)" and remote["run_plan"]["generation_gathered"] is False
