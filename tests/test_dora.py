"""DoRA, rsLoRA and --lora-init: N ranks equal 1 rank, and the adapter loads in peft and merges."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from shardtune.config import ConfigError, build_config, validate
from test_equivalence import INPUT, grads_and_training

from dist_utils import run_ranks
from tiny import instruction_records, make_model, write_jsonl


def _options(root: Path, out: str, **extra) -> dict:
    return {"model": str(root / "model"), "data": str(root / "train.jsonl"), "out": str(root / out),
            "dtype": "fp32", "steps": 3, "batch-size": 4, "lr": 1e-2, "warmup-steps": 1, "seed": 1,
            "lora-variant": "dora", "lora-rslora": True, "lora-init": "gaussian", "lora-r": 4, **extra}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, list, list]:
    root = tmp_path_factory.mktemp("dora")
    make_model(root / "model", "llama", tied=True)
    write_jsonl(root / "train.jsonl", instruction_records(12))
    one = run_ranks(grads_and_training, 1, _options(root, "one", strategy="single"))
    two = run_ranks(grads_and_training, 2, _options(root, "two", strategy="fsdp2", **{"micro-batch-size": 1}))
    return root, one, two


def test_dora_two_ranks_fsdp2_equal_one_rank(runs) -> None:
    from transformers import AutoModelForCausalLM

    root, one, two = runs
    base = AutoModelForCausalLM.from_pretrained(root / "model").eval()
    with torch.no_grad():
        base_logits = base(input_ids=INPUT).logits
    # B = 0 and magnitude = row norms of the loaded shards: the untrained model is the base model.
    for run in (one[0], two[0]):
        torch.testing.assert_close(run["before"], base_logits, rtol=1e-4, atol=1e-4)
    magnitudes = [n for n in one[0]["grads"] if "lora_magnitude_vector" in n]
    assert magnitudes and set(one[0]["grads"]) == set(two[0]["grads"])
    for name, g in one[0]["grads"].items():
        torch.testing.assert_close(two[0]["grads"][name], g, rtol=1e-4, atol=1e-6, msg=name)
    assert all(one[0]["grads"][n].abs().sum() > 0 for n in magnitudes)
    torch.testing.assert_close(torch.tensor(two[0]["losses"]), torch.tensor(one[0]["losses"]), rtol=1e-5, atol=1e-6)


def test_dora_adapter_loads_in_peft_and_merges(runs, tmp_path: Path) -> None:
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from shardtune.tools.merge import merge

    root, one, two = runs
    adapter = root / "two" / "adapter"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["use_dora"] and config["use_rslora"] and config["init_lora_weights"] == "gaussian"
    a = load_file(root / "one" / "adapter" / "adapter_model.safetensors")
    b = load_file(adapter / "adapter_model.safetensors")
    assert set(a) == set(b) and any(k.endswith("lora_magnitude_vector") for k in a)
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-6, msg=k)
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(root / "model"), adapter).eval()
    with torch.no_grad():
        expected = peft_model(input_ids=INPUT).logits
    torch.testing.assert_close(two[0]["logits"], expected, rtol=1e-4, atol=1e-4)
    assert (expected - two[0]["before"]).abs().max() > 1e-3  # trained: the check is not vacuous

    merge(root / "model", adapter, tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=INPUT).logits, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("init", ["pissa", "pissa_niter_4", "olora", "loftq", "eva", "corda"])
def test_whole_weight_inits_are_refused(init: str) -> None:
    cfg = build_config({"model": "m", "data": "d", "out": "o", "lora-init": init})
    with pytest.raises(ConfigError, match="lora-init.*whole base weight|lora-init.*data"):
        validate(cfg)


def test_unknown_init_and_dora_under_fsdp1_are_refused() -> None:
    with pytest.raises(ConfigError, match="not one of default, gaussian"):
        validate(build_config({"model": "m", "data": "d", "out": "o", "lora-init": "zeros"}))
    with pytest.raises(ConfigError, match="dora does not work under --strategy fsdp1"):
        validate(build_config({"model": "m", "data": "d", "out": "o", "lora-variant": "dora", "strategy": "fsdp1"}))
