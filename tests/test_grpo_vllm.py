"""GRPO with a vLLM generator (``--vllm-url``), as a user starts it (``shardtune finetune``), against the stub
server of tests/vllm_stub.py: before each generation batch the adapter alone is written and loaded as the
version of that optimizer step, checked served, and the policy trains on the server's completions; a server
that does not take a new version stops the run; an unreachable server, one without runtime LoRA, or an adapter
vLLM cannot load are refused before any worker starts."""

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
    # and training consumed the server's completions
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3
    for m in rows:
        assert m["completions/mean_length"] == pytest.approx((2 + 3 + 4 + LIMIT) / 4)  # EOS counted, as TRL
        assert m["completions/clipped_ratio"] == pytest.approx(0.25)
        assert m["reward"] == pytest.approx((1 + 0 + 3 + LIMIT) / 4)
    samples = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    assert [s["completion"] for s in samples if s["step"] == 1] == [*TEXTS, "9" * LIMIT]
    assert [s["truncated"] for s in samples if s["step"] == 1] == [False, False, False, True]


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
