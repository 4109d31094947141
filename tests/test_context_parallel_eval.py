"""`shardtune eval --context-parallel`: the loss with each sequence cut over a CP group equals one process's
(fp32, 1e-5), on records of uneven length whose widths the pieces do not always divide (padded, never
counted), with an adapter; the answers are still generated whole. And the bad input, refused before any
model is loaded (exit 2, naming the flag): ranks the groups do not divide, an attention the pieces cannot
meet in, and the kinds of eval that run in one process (preference pairs)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from shardtune.cli import main
from test_preference_ranks import preference_pairs

from tiny import instruction_records, make_model, write_jsonl


@pytest.fixture(scope="module")
def eval_root(tmp_path_factory) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("cp-eval")
    make_model(root / "model", "llama")
    torch.manual_seed(3)  # random (not zero) B: the adapter changes the loss
    base = AutoModelForCausalLM.from_pretrained(root / "model")
    get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                                    init_lora_weights=False)).save_pretrained(root / "adapter")
    records = instruction_records(9, seed=7) + [{"text": "the sea and the moon and a bird"}]
    write_jsonl(root / "data.jsonl", records)
    write_jsonl(root / "pairs.jsonl", preference_pairs(4))
    return root


def _eval(root: Path, capsys, *extra: str) -> dict:
    args = ["eval", "--model", str(root / "model"), "--adapter", str(root / "adapter"), "--data",
            str(root / "data.jsonl"), "--json", "--dtype", "fp32", "--batch-size", "3", "--max-new-tokens", "3",
            "--answers", *extra]
    assert main(args) == 0
    return json.loads(capsys.readouterr().out)


def test_eval_loss_with_context_parallel_equals_one_process(eval_root, capsys):
    one = _eval(eval_root, capsys)
    cp = _eval(eval_root, capsys, "--nproc", "2", "--context-parallel", "2")
    assert (cp["world_size"], cp["context_parallel"], one["context_parallel"]) == (2, 2, 1)
    assert cp["target_tokens"] == one["target_tokens"] and cp["records"] == one["records"] == 10
    assert abs(cp["loss"] - one["loss"]) < 1e-5, (cp["loss"], one["loss"])
    assert [a["answer"] for a in cp["answers"]] == [a["answer"] for a in one["answers"]]


@pytest.fixture
def nothing_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if eval would load a model or start workers."""
    import shardtune.runtime.workers
    import shardtune.tools.generate

    def refuse(*args, **kwargs):  # pragma: no cover - reached only when bad input got past the checks
        raise AssertionError("the checks passed: a model would have been loaded")

    monkeypatch.setattr(shardtune.runtime.workers, "launch_workers", refuse)
    monkeypatch.setattr(shardtune.tools.generate, "load_model", refuse)
    monkeypatch.setattr(shardtune.tools.generate.EvalModel, "load", refuse)


@pytest.mark.parametrize("model,data,extra,words", [
    ("model", "data.jsonl", ["--nproc", "3"], ["context-parallel", "does not divide the 3 ranks (--nproc)"]),
    ("model", "data.jsonl", ["--nproc", "1"], ["context-parallel", "does not divide the 1 ranks"]),
    ("falcon", "data.jsonl", ["--nproc", "2"], ["context-parallel", "falcon", "without --context-parallel"]),
    ("model", "pairs.jsonl", ["--nproc", "2"], ["context-parallel", "preference pairs", "one process"]),
])
def test_eval_refuses_context_parallel_it_cannot_split(eval_root, nothing_loads, capsys, model, data, extra, words):
    if model == "falcon" and not (eval_root / "falcon").is_dir():
        make_model(eval_root / "falcon", "falcon")
    args = ["eval", "--model", str(eval_root / model), "--data", str(eval_root / data), "--context-parallel", "2",
            "--max-new-tokens", "0", *extra]
    assert main(args) == 2
    err = capsys.readouterr().err
    for word in words:
        assert word in err, (word, err)
