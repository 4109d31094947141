"""``shardtune merge``: base + adapter folded into one Hugging Face directory, streamed tensor by tensor."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tiny import make_model

INPUT = torch.arange(1, 31).reshape(2, 15) * 11 % 250

CASES = {
    # name: (arch, tied, sharded, peft LoraConfig options)
    "llama-sharded-rslora": ("llama", False, True, {"use_rslora": True, "alpha_pattern": {"q_proj": 3.0}}),
    "llama-tied-lm_head-saved": ("llama", True, False, {"modules_to_save": ["lm_head"]}),
    "gpt2-conv1d-bias-lora_only": ("gpt2", False, True, {"bias": "lora_only", "rank_pattern": {"c_fc": 2}}),
    "gpt2-tied-bias-all": ("gpt2", True, False, {"bias": "all"}),
}


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=INPUT).logits


def _random_adapter(model_dir: Path, out: Path, options: dict) -> None:
    """A peft adapter with every trainable tensor random (peft starts B at zero: no change to merge)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM", **options)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir), config)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.normal_(0, 0.1)
    model.save_pretrained(out)


@pytest.mark.parametrize("case", list(CASES))
def test_merged_model_gives_base_plus_adapter_logits(tmp_path, case):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from shardtune.cli import main

    arch, tied, sharded, options = CASES[case]
    base_dir, adapter_dir, merged_dir = tmp_path / "base", tmp_path / "adapter", tmp_path / "merged"
    make_model(base_dir, arch, tied=tied, sharded=sharded)
    _random_adapter(base_dir, adapter_dir, options)
    expected = _logits(PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), adapter_dir))
    base = _logits(AutoModelForCausalLM.from_pretrained(base_dir))
    assert (expected - base).abs().max() > 0.1  # the adapter matters

    assert main(["merge", "--model", str(base_dir), "--adapter", str(adapter_dir), "--out", str(merged_dir)]) == 0
    torch.testing.assert_close(_logits(AutoModelForCausalLM.from_pretrained(merged_dir)), expected,
                               rtol=1e-5, atol=1e-5)
    files = sorted(p.name for p in base_dir.iterdir())
    assert sorted(p.name for p in merged_dir.iterdir()) == files  # weights, index, config, tokenizer
    if sharded:
        index = json.loads((merged_dir / "model.safetensors.index.json").read_text())
        assert index["weight_map"] == json.loads((base_dir / "model.safetensors.index.json").read_text())["weight_map"]
    # A tied lm_head the adapter replaces gets its own tensor, and the config no longer ties it.
    untied = "modules_to_save" in options and tied
    assert json.loads((merged_dir / "config.json").read_text())["tie_word_embeddings"] == (tied and not untied)
    assert not list(tmp_path.glob(".merged*"))


def test_dtype_option_and_errors(tmp_path, capsys):
    from safetensors import safe_open

    from shardtune.cli import main

    make_model(tmp_path / "base", "llama")
    _random_adapter(tmp_path / "base", tmp_path / "adapter", {})
    args = ["merge", "--model", str(tmp_path / "base"), "--adapter", str(tmp_path / "adapter")]
    assert main([*args, "--out", str(tmp_path / "bf16"), "--dtype", "bf16"]) == 0
    with safe_open(str(tmp_path / "bf16" / "model.safetensors"), framework="pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"

    make_model(tmp_path / "gpt2", "gpt2")
    assert main(["merge", "--model", str(tmp_path / "gpt2"), "--adapter", str(tmp_path / "adapter"),
                 "--out", str(tmp_path / "wrong")]) == 2
    assert "which the model's checkpoint does not have" in capsys.readouterr().err
    assert not (tmp_path / "wrong").exists()


MEASURE = """
import json, sys
import peft.utils.other, safetensors, torch  # imported before measuring: libraries are not the merge's memory
from shardtune.runtime.memory import MemoryMonitor, resident_bytes
from shardtune.tools.merge import merge
monitor = MemoryMonitor(torch.device("cpu"), interval=0.002)
start = resident_bytes()
with monitor.phase("merge"):
    result = merge(sys.argv[1], sys.argv[2], sys.argv[3])
print(json.dumps({**result, "increase_bytes": monitor.peaks["merge"]["resident_mb"] * 2**20 - start}))
"""


def _big_random_checkpoint(root: Path, layers: int = 12, hidden: int = 512, inner: int = 1024) -> None:
    """A ~120 MB Llama checkpoint (one file per layer) and a rank-8 adapter on every linear layer."""
    from safetensors.torch import save_file

    shapes = {"self_attn.q_proj": (hidden, hidden), "self_attn.k_proj": (hidden, hidden),
              "self_attn.v_proj": (hidden, hidden), "self_attn.o_proj": (hidden, hidden),
              "mlp.gate_proj": (inner, hidden), "mlp.up_proj": (inner, hidden), "mlp.down_proj": (hidden, inner)}
    (root / "model").mkdir(parents=True)
    (root / "adapter").mkdir()
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
              "intermediate_size": inner, "num_hidden_layers": layers, "num_attention_heads": 8,
              "num_key_value_heads": 8, "vocab_size": 320, "max_position_embeddings": 128}
    (root / "model" / "config.json").write_text(json.dumps(config))
    g = torch.Generator().manual_seed(0)
    weight_map, adapter = {}, {}
    for i in range(layers + 1):
        if i < layers:
            prefix = f"model.layers.{i}."
            tensors = {f"{prefix}{m}.weight": torch.randn(s, generator=g) * 0.02 for m, s in shapes.items()}
            for m, (rows, cols) in shapes.items():
                adapter[f"base_model.model.{prefix}{m}.lora_A.weight"] = torch.randn(8, cols, generator=g) * 0.01
                adapter[f"base_model.model.{prefix}{m}.lora_B.weight"] = torch.randn(rows, 8, generator=g) * 0.01
        else:
            tensors = {"model.embed_tokens.weight": torch.randn(320, hidden, generator=g),
                       "lm_head.weight": torch.randn(320, hidden, generator=g), "model.norm.weight": torch.ones(hidden)}
        name = f"model-{i + 1:05d}-of-{layers + 1:05d}.safetensors"
        save_file(tensors, str(root / "model" / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
    (root / "model" / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    save_file(adapter, str(root / "adapter" / "adapter_model.safetensors"))
    (root / "adapter" / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": sorted({m.split(".")[1] for m in shapes})}))


def test_merge_peak_memory_is_a_few_tensors_not_the_model(tmp_path):
    _big_random_checkpoint(tmp_path)
    model_bytes = sum(f.stat().st_size for f in (tmp_path / "model").glob("*.safetensors"))
    adapter_bytes = (tmp_path / "adapter" / "adapter_model.safetensors").stat().st_size
    done = subprocess.run([sys.executable, "-c", MEASURE, str(tmp_path / "model"), str(tmp_path / "adapter"),
                           str(tmp_path / "merged")], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    largest = result["largest_tensor_bytes"]
    print(f"\nmerge: model {model_bytes / 2**20:.1f} MB, largest tensor {largest / 2**20:.1f} MB, "
          f"adapter {adapter_bytes / 2**20:.1f} MB, peak resident increase {result['increase_bytes'] / 2**20:.1f} MB")
    assert model_bytes > 50 * largest
    # The adapter is read whole (it is small); of the model, a few tensors' worth at a time.
    assert result["increase_bytes"] < adapter_bytes + 4 * largest + 8 * 2**20
    assert result["increase_bytes"] < model_bytes / 8
