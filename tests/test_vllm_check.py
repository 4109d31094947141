"""`shardtune export --check vllm`: what vLLM would refuse in an adapter, each with its fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from shardtune.cli import main

LORA = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(8, 32),
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(32, 8)}


def _lora(r: int) -> dict:
    """LORA at rank ``r``: an adapter's tensors agree with its config (every command checks it)."""
    return {k: torch.zeros(r, 32) if "lora_A" in k else torch.zeros(32, r) for k in LORA}


def _adapter(path: Path, tensors: dict | None = None, **config) -> Path:
    path.mkdir()
    cfg = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"], **config}
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    rank = max([cfg["r"], *(cfg.get("rank_pattern") or {}).values()])
    save_file(tensors or _lora(rank), str(path / "adapter_model.safetensors"))
    return path


def _check(adapter: Path, capsys, *extra: str) -> tuple[int, str]:
    code = main(["export", "--adapter", str(adapter), "--check", "vllm", *extra])
    return code, capsys.readouterr().out


def test_plain_lora_passes(tmp_path, capsys):
    code, out = _check(_adapter(tmp_path / "a"), capsys)
    assert code == 0 and "should load" in out


@pytest.mark.parametrize("config,tensors,expected,fix", [
    ({"modules_to_save": ["lm_head"]}, None, "modules_to_save", "shardtune merge"),
    ({}, {**LORA, "base_model.model.lm_head.weight": torch.zeros(4, 32)}, "embedding/lm_head weights", "merge"),
    ({}, {**LORA, "base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(8, 4),
           "base_model.model.model.embed_tokens.lora_embedding_B": torch.zeros(32, 8)}, "LoRA on the embedding",
     "--lora-targets"),
    ({"use_dora": True}, {**LORA, "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector":
                          torch.ones(32)}, "DoRA", "--lora-variant lora"),
    ({"r": 32}, None, "rank 32 above vLLM's --max-lora-rank 16", "--max-lora-rank 32"),
    ({"rank_pattern": {"q_proj": 64}}, None, "rank 64", "--max-lora-rank 64"),
])
def test_each_refusal_is_listed_with_its_fix(tmp_path, capsys, config, tensors, expected, fix):
    code, out = _check(_adapter(tmp_path / "a", tensors, **config), capsys)
    assert code == 1 and expected in out and fix in out, out


def test_raised_max_lora_rank_accepts_the_rank(tmp_path, capsys):
    adapter = _adapter(tmp_path / "a", r=32)
    assert _check(adapter, capsys, "--max-lora-rank", "32")[0] == 0


def test_missing_adapter_is_exit_2(tmp_path, capsys):
    assert main(["export", "--adapter", str(tmp_path / "nope"), "--check", "vllm"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_after_training_the_problems_are_warnings_and_the_summary_is_kept(tmp_path, caplog):
    from shardtune.tools.vllm_check import warn_after_training

    adapter = _adapter(tmp_path / "adapter", r=64, use_dora=True)
    summary = {"adapter": str(adapter), "steps": 3}
    with caplog.at_level("WARNING", logger="shardtune"):
        assert warn_after_training(summary) is summary
    text = caplog.text
    assert "vLLM would refuse" in text and "DoRA" in text and "--max-lora-rank 64" in text
    caplog.clear()
    assert warn_after_training({"adapter": str(tmp_path / "gone")}) == {"adapter": str(tmp_path / "gone")}
    assert warn_after_training({}) == {} and not caplog.text
