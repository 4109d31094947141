"""GGUF export, checked by an implementation no one here wrote: transformers' own GGUF reader.

Each family gets a tiny random model with a real BPE tokenizer (merges, ChatML specials) and a LoRA
adapter with non-zero B; ``shardtune export`` writes the GGUF, transformers loads it, and its logits
and token ids are compared with the ``shardtune merge`` output loaded from safetensors.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

gguf = pytest.importorskip("gguf")

from shardtune.cli import main  # noqa: E402

VOCAB = 352
SPECIALS = ["<|im_start|>", "<|im_end|>"]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WORDS = ["the", "cat", "sat", "on", "mat", "Zarnovia", "capital", "river", "café", "naïve", "東京", "🙂", "x=1;", "42",
         "1999", "don't", "  spaced", "\ttab", "new\nline", "UPPER"]
# Q8_0 stores each block of 32 weights as int8 with one f16 scale. Against the unquantized merged model
# the largest logit difference, as a fraction of the logits' standard deviation, stays below this on
# these random models (whose weights are far less smooth than trained ones).
Q8_TOLERANCE = 0.4


def _texts(n: int = 300) -> list[str]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        k = int(torch.randint(1, 8, (1,), generator=g))
        sep = [" ", "", "  ", "\n", ", "][int(torch.randint(0, 5, (1,), generator=g))]
        out.append(sep.join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (k,), generator=g)))
    return out


def _byte_level_tokenizer():
    from transformers import GPT2Tokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("a", "t"), ("Ġ", "c"), ("Ġc", "at"), ("i", "n"), ("o", "n")]
    symbols = list(bytes_to_unicode().values())
    vocab = {t: i for i, t in enumerate(["<|endoftext|>", *symbols, *("".join(m) for m in merges)])}
    tok = GPT2Tokenizer(vocab=vocab, merges=merges, unk_token="<|endoftext|>", bos_token="<|endoftext|>",
                        eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.add_special_tokens({"additional_special_tokens": SPECIALS})
    return tok


def _sentencepiece_tokenizer(cls_name: str = "LlamaTokenizer"):
    import transformers

    merges = [("▁", "t"), ("h", "e"), ("▁t", "he"), ("a", "t"), ("▁", "c"), ("▁c", "at"), ("i", "n"), ("o", "n")]
    chars = sorted(set("▁abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,;:'=-"))
    pieces = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *chars, *("".join(m) for m in merges)]
    vocab = {t: i for i, t in enumerate(dict.fromkeys(pieces))}
    cls = getattr(transformers, cls_name)
    kwargs = {"bos_token": "<bos>", "eos_token": "<eos>", "unk_token": "<unk>", "pad_token": "<pad>"} \
        if cls_name == "GemmaTokenizer" else {}
    if kwargs:
        vocab = {t: i for i, t in enumerate(dict.fromkeys(["<pad>", "<eos>", "<bos>", *pieces]))}
    tok = cls(vocab=vocab, merges=merges, **kwargs)
    tok.add_special_tokens({"additional_special_tokens": SPECIALS})
    return tok


def _gemma3_text_config(**kwargs):
    """Six layers (the sixth global, the rest sliding) with a window of 8, shorter than the 24 tokens the
    tests run. transformers' GGUF reader takes Gemma 3's shape, rope base and sliding window from the file
    but leaves at its defaults: query_pre_attn_scalar (256), layer_types (every sixth layer global), the
    sliding layers' rope base (10000), rope scaling and final_logit_softcapping. This config has those
    defaults, so the loaded model is the one written; head_dim 256 makes query_pre_attn_scalar also the
    1/sqrt(head_dim) scale llama.cpp uses."""
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(**{**DIMS, "tie_word_embeddings": True, "num_hidden_layers": 6, **kwargs}, head_dim=256,
                            sliding_window=8)


def _config(family: str):
    from transformers import Gemma2Config, Gemma3Config, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    dims = DIMS
    if family == "llama":
        return LlamaConfig(**dims)
    if family == "mistral":
        return MistralConfig(**dims, sliding_window=None)
    if family == "qwen2":
        return Qwen2Config(**dims)
    if family == "qwen3":  # transformers' GGUF reader leaves Qwen3's head_dim at its default
        return Qwen3Config(**dims, head_dim=Qwen3Config().head_dim)
    if family == "gemma2":  # tied, as every Gemma; the reader leaves softcapping and scaling at their defaults
        return Gemma2Config(**{**dims, "tie_word_embeddings": True}, head_dim=16, sliding_window=128)
    if family == "gemma3_text":
        return _gemma3_text_config()
    if family == "gemma3":  # Gemma3ForConditionalGeneration: the text model above and a one-layer vision tower
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      image_size=28, patch_size=14)
        return Gemma3Config(text_config=_gemma3_text_config().to_dict(), vision_config=vision, mm_tokens_per_image=1)
    raise ValueError(family)


DIMS = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)


CASES = {  # name: (family, tokenizer)
    "llama-spm": ("llama", "spm"), "llama-bpe": ("llama", "bpe"), "mistral": ("mistral", "spm"),
    "qwen2": ("qwen2", "bpe"), "qwen3": ("qwen3", "bpe"), "gemma2": ("gemma2", "gemma"),
    "gemma3": ("gemma3_text", "gemma"), "gemma3-vision": ("gemma3", "gemma"),
}


def make_case(root: Path, family: str, tokenizer: str) -> tuple[Path, Path]:
    """A tiny random base model (+ tokenizer) and a LoRA adapter on every linear layer, B non-zero."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(family))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # near 1 (Gemma stores w - 1: near 0) keeps activations sane
                p.normal_(0.0 if family.startswith("gemma") else 1.0, 0.05)
            else:
                p.normal_(0, 0.2)
    base = root / "base"
    model.save_pretrained(base)
    tok = {"bpe": _byte_level_tokenizer, "spm": _sentencepiece_tokenizer,
           "gemma": lambda: _sentencepiece_tokenizer("GemmaTokenizer")}[tokenizer]()
    tok.chat_template = CHATML
    tok.save_pretrained(base)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    peft_model.save_pretrained(root / "adapter")
    return base, root / "adapter"


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    base, adapter = make_case(root, *CASES[request.param])
    assert main(["merge", "--model", str(base), "--adapter", str(adapter), "--out", str(root / "merged")]) == 0
    return root, base, adapter


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def _rounded(model, quant: str):
    """The merged model with its matrices rounded as the GGUF stores them (norms and biases stay fp32);
    Q8_0 through the gguf package's own quantize/dequantize."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() != 2:
                continue
            if quant == "q8_0":
                q8 = gguf.GGMLQuantizationType.Q8_0
                p.copy_(torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(p.numpy(), q8), q8)))
            else:
                p.copy_(p.to({"f16": torch.float16, "bf16": torch.bfloat16}[quant]).float())
    return model


@pytest.mark.parametrize("quant", ["f16", "bf16", "q8_0"])
def test_gguf_loads_in_transformers_with_the_merged_logits(case, quant):
    from transformers import AutoModelForCausalLM

    root, base, adapter = case
    out = root / f"model-{quant}.gguf"
    assert main(["export", "--model", str(base), "--adapter", str(adapter), "--format", "gguf", "--out", str(out),
                 "--quant", quant, "--force"]) == 0
    merged = AutoModelForCausalLM.from_pretrained(root / "merged", dtype=torch.float32).eval()
    loaded = AutoModelForCausalLM.from_pretrained(root, gguf_file=out.name, dtype=torch.float32).eval()
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))
    got = _logits(loaded, ids)
    if quant == "q8_0":  # against fp32: the documented tolerance
        diff = (got - _logits(merged, ids)).abs().max() / _logits(merged, ids).std()
        assert diff < Q8_TOLERANCE, diff.item()
    torch.testing.assert_close(got, _logits(_rounded(merged, quant), ids), rtol=1e-4, atol=1e-4)
    base_logits = _logits(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval(), ids)
    assert (got - base_logits).abs().max() > 1.0  # the adapter is in the file


@pytest.mark.parametrize("quant", ["f16", "bf16", "q8_0"])
def test_blocks_of_rows_write_the_bytes_of_whole_tensors(case, quant, monkeypatch):
    """Matrices are converted and written a block of rows at a time. With one row a block (every row
    boundary a block boundary, the q/k permutation taken across blocks) the file is the one that
    whole tensors in one block give."""
    from shardtune.tools import export

    root, base, adapter = case
    written = {}
    for values in (1 << 30, 1):
        monkeypatch.setattr(export, "_BLOCK_VALUES", values)
        out = root / f"blocks-{values}-{quant}.gguf"
        assert main(["export", "--model", str(base), "--adapter", str(adapter), "--out", str(out),
                     "--quant", quant, "--force"]) == 0
        written[values] = out.read_bytes()
    assert written[1] == written[1 << 30]


def test_gguf_tokenizer_gives_the_same_ids(case):
    from transformers import AutoTokenizer

    root, base, adapter = case
    out = root / "tok.gguf"
    assert main(["export", "--model", str(base), "--out", str(out), "--force"]) == 0
    want = AutoTokenizer.from_pretrained(base)
    got = AutoTokenizer.from_pretrained(root, gguf_file=out.name)
    chats = [[{"role": "user", "content": t}, {"role": "assistant", "content": t[::-1]}] for t in _texts(20)]
    texts = _texts() + [want.apply_chat_template(c, tokenize=False) for c in chats]
    for text in texts:
        assert got(text)["input_ids"] == want(text)["input_ids"], text
    assert got.eos_token == want.eos_token
    assert got.chat_template == want.chat_template
    for chat in chats[:5]:
        assert got.apply_chat_template(chat, tokenize=True) == want.apply_chat_template(chat, tokenize=True)


def test_modelfile_template_and_stop_tokens(case):
    root, base, adapter = case
    out = root / "mf.gguf"
    assert main(["export", "--model", str(base), "--adapter", str(adapter), "--out", str(out), "--force"]) == 0
    text = (root / "mf.Modelfile").read_text()
    assert text.startswith("FROM ./mf.gguf\n")
    assert 'TEMPLATE """{{- range .Messages }}{{- if eq .Role "system" }}<|im_start|>system\n{{ .Content }}' in text
    template = text.split('TEMPLATE """', 1)[1].split('"""', 1)[0]
    assert '<|im_end|>\n{{ else if eq .Role "user" }}' in template and _dashes_follow_no_text(template)
    assert 'PARAMETER stop "<|im_end|>"' in text


def test_existing_out_is_refused_without_force(tmp_path, capsys):
    base, adapter = make_case(tmp_path, "llama", "bpe")
    out = tmp_path / "m.gguf"
    out.write_bytes(b"keep me")
    assert main(["export", "--model", str(base), "--adapter", str(adapter), "--out", str(out)]) == 2
    assert "already exists" in capsys.readouterr().err and out.read_bytes() == b"keep me"
    assert not (tmp_path / "m.Modelfile").exists()
    assert main(["export", "--model", str(base), "--adapter", str(adapter), "--out", str(out), "--force"]) == 0
    assert out.read_bytes()[:4] == b"GGUF"
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_bad_inputs_exit_2_and_write_nothing(tmp_path, capsys):
    from transformers import AutoModelForCausalLM, GPT2Config

    from tiny import make_model

    base, adapter = make_case(tmp_path / "a", "llama", "bpe")
    out = tmp_path / "out.gguf"

    def run(*args: str) -> str:
        assert main(["export", "--out", str(out), *args]) == 2
        assert not out.exists() and not list(tmp_path.glob(".out.gguf*"))
        return capsys.readouterr().err

    assert "--quant 'q4_k'" in run("--model", str(base), "--adapter", str(adapter), "--quant", "q4_k")
    other = make_model(tmp_path / "small", "llama", hidden=32)  # the same tensor names, other shapes
    assert "does not fit" in run("--model", str(other), "--adapter", str(adapter))
    truncated = tmp_path / "truncated"
    truncated.mkdir()
    (truncated / "adapter_config.json").write_text((adapter / "adapter_config.json").read_text())
    data = (adapter / "adapter_model.safetensors").read_bytes()
    (truncated / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    assert "adapter_model.safetensors" in run("--model", str(base), "--adapter", str(truncated))
    gpt2 = tmp_path / "gpt2"
    AutoModelForCausalLM.from_config(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=VOCAB)).save_pretrained(gpt2)
    assert "model_type 'gpt2'" in run("--model", str(gpt2))


def test_gemma_v1_gets_llama_cpp_names_and_norms_plus_one(tmp_path):
    """transformers cannot read a Gemma (v1) GGUF, so the gguf package's reader checks the file."""
    from transformers import AutoModelForCausalLM, GemmaConfig

    cfg = GemmaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=1, head_dim=16)
    model = AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(tmp_path / "gemma")
    tok = _sentencepiece_tokenizer("GemmaTokenizer")
    tok.chat_template = CHATML
    tok.save_pretrained(tmp_path / "gemma")
    out = tmp_path / "g.gguf"
    assert main(["export", "--model", str(tmp_path / "gemma"), "--out", str(out)]) == 0
    reader = gguf.GGUFReader(str(out))
    arch = reader.fields["general.architecture"]
    assert bytes(arch.parts[arch.data[0]]).decode() == "gemma"
    tensors = {t.name: t for t in reader.tensors}
    assert "output.weight" not in tensors and "blk.0.attn_q.weight" in tensors
    norm = torch.from_numpy(tensors["blk.0.attn_norm.weight"].data.copy())
    torch.testing.assert_close(norm, model.model.layers[0].input_layernorm.weight.detach() + 1)


def _modelfile_for(tmp_path: Path, template: str, specials: list[str]) -> str:
    base, _ = make_case(tmp_path, "llama", "bpe")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base)
    tok.add_special_tokens({"additional_special_tokens": specials})
    tok.chat_template = template
    tok.save_pretrained(base)
    assert main(["export", "--model", str(base), "--out", str(tmp_path / "m.gguf")]) == 0
    return (tmp_path / "m.Modelfile").read_text()


def test_llama3_style_template_becomes_a_go_template(tmp_path):
    llama3 = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
              "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
              "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
    text = _modelfile_for(tmp_path, llama3, ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"])
    assert '{{ else if eq .Role "user" }}<|start_header_id|>user<|end_header_id|>\n\n{{ .Content }}<|eot_id|>' in text
    assert text.rstrip().endswith('PARAMETER stop "<|eot_id|>"')


# Gemma 3's chat template (text content only): no system turn, the system text opens the first user message.
GEMMA3_TEMPLATE = (
    "{{ bos_token }}{%- if messages[0]['role'] == 'system' -%}{%- set first_user_prefix = messages[0]['content'] + "
    "'\n\n' -%}{%- set loop_messages = messages[1:] -%}{%- else -%}{%- set first_user_prefix = '' -%}"
    "{%- set loop_messages = messages -%}{%- endif -%}{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}{{ message['content'] | trim }}"
    "{{ '<end_of_turn>\n' }}{%- endfor -%}{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}")
# Gemma 1 and 2: the same turns, and a system message is an error.
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}")


def _dashes_follow_no_text(template: str) -> bool:
    """Go's ``{{-`` trims the whitespace of the text before it: only actions that follow another action
    (or open the template) may carry it, or the newline that ends a turn is lost."""
    return all(i == 0 or template[:i].endswith("}}") for i in range(len(template)) if template.startswith("{{-", i))


def test_gemma3_template_puts_the_system_text_into_the_first_user_turn(tmp_path):
    text = _modelfile_for(tmp_path, GEMMA3_TEMPLATE, ["<start_of_turn>", "<end_of_turn>"])
    template = text.split('TEMPLATE """', 1)[1].split('"""', 1)[0]
    assert ('{{- if eq .Role "user" }}<start_of_turn>user\n{{ if and $first $system }}{{ $system }}\n\n{{ end }}'
            "{{ $first = false }}{{ .Content }}<end_of_turn>\n") in template
    assert '{{ else if eq .Role "assistant" }}<start_of_turn>model\n{{ .Content }}<end_of_turn>\n' in template
    assert template.endswith("{{ end }}{{ end }}<start_of_turn>model\n") and _dashes_follow_no_text(template)
    assert 'PARAMETER stop "<end_of_turn>"' in text


def test_gemma2_template_without_system_turns_gets_its_turns(tmp_path):
    text = _modelfile_for(tmp_path, GEMMA_TEMPLATE, ["<start_of_turn>", "<end_of_turn>"])
    template = text.split('TEMPLATE """', 1)[1].split('"""', 1)[0]
    assert template == ('{{- range .Messages }}{{- if eq .Role "user" }}<start_of_turn>user\n{{ .Content }}'
                        '<end_of_turn>\n{{ else if eq .Role "assistant" }}<start_of_turn>model\n{{ .Content }}'
                        "<end_of_turn>\n{{ end }}{{ end }}<start_of_turn>model\n")
    assert 'PARAMETER stop "<end_of_turn>"' in text


def test_default_system_prompt_of_the_demo_model_becomes_the_modelfiles_system(tmp_path):
    """SmolLM2-Instruct's ChatML adds a system turn of its own to a conversation without one: Ollama's SYSTEM
    does exactly that, so the Modelfile carries TEMPLATE and SYSTEM (checked against the Jinja template with
    and without a system message in modelfile._pieces)."""
    from tiny import SMOLLM2_CHAT_TEMPLATE

    text = _modelfile_for(tmp_path, SMOLLM2_CHAT_TEMPLATE, ["<|im_start|>", "<|im_end|>"])
    template = text.split('TEMPLATE """', 1)[1].split('"""', 1)[0]
    assert template == ('{{- range .Messages }}{{- if eq .Role "system" }}<|im_start|>system\n{{ .Content }}'
                        '<|im_end|>\n{{ else if eq .Role "user" }}<|im_start|>user\n{{ .Content }}<|im_end|>\n'
                        '{{ else if eq .Role "assistant" }}<|im_start|>assistant\n{{ .Content }}<|im_end|>\n'
                        "{{ end }}{{ end }}<|im_start|>assistant\n")
    assert 'SYSTEM """You are a helpful AI assistant named SmolLM, trained by Hugging Face"""' in text
    assert 'PARAMETER stop "<|im_end|>"' in text


def test_untranslatable_template_is_said_not_guessed(tmp_path):
    odd = ("{% for m in messages %}{% if loop.first %}FIRST {% endif %}[{{ m['role'] }}] {{ m['content'] }}\n"
           "{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}")
    text = _modelfile_for(tmp_path, odd, [])
    assert "TEMPLATE" not in text.replace("# No TEMPLATE", "") and "# No TEMPLATE: the chat template does more" in text


def test_llama3_rope_scaling_becomes_llama_cpps_rope_freqs(tmp_path):
    """Llama 3.1's rope goes into the file as llama.cpp's ``rope_freqs`` divisors: base frequency over
    transformers' own scaled one. transformers' GGUF reader does not read that tensor back, so the
    rest of the file is checked through it with the scaling given as the config."""
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    # head_dim 16, theta 1e4: wavelengths 6, 20, 63, 198, ... against bounds 64/4 and 64/1, so the
    # divisors take all three branches (1, the smooth blend, factor).
    rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      rope_parameters=rope)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(tmp_path / "base")
    tok = _byte_level_tokenizer()
    tok.chat_template = CHATML
    tok.save_pretrained(tmp_path / "base")
    out = tmp_path / "l3.gguf"
    assert main(["export", "--model", str(tmp_path / "base"), "--out", str(out)]) == 0

    tensors = {t.name: t for t in gguf.GGUFReader(str(out)).tensors}
    freqs = tensors["rope_freqs.weight"]
    assert freqs.tensor_type == gguf.GGMLQuantizationType.F32
    base_inv = 1.0 / (rope["rope_theta"] ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
    scaled_inv, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    torch.testing.assert_close(torch.from_numpy(freqs.data.copy()), base_inv / scaled_inv, rtol=1e-5, atol=0)
    assert {1.0, 8.0} < set(freqs.data.tolist())  # and values in between

    config = AutoConfig.from_pretrained(tmp_path / "base")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=out.name, config=config,
                                                  dtype=torch.float32).eval()
    ids = torch.randint(0, VOCAB, (1, 200), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(_logits(loaded, ids), _logits(_rounded(model.eval(), "f16"), ids), rtol=1e-4, atol=1e-4)


def _gemma3_base(root: Path, **config) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_gemma3_text_config(**config))
    model.save_pretrained(root)
    tok = _sentencepiece_tokenizer("GemmaTokenizer")
    tok.chat_template = CHATML
    tok.save_pretrained(root)
    return root


def _field(reader, key: str):
    field = reader.fields[key]
    value = field.parts[field.data[0]]
    return bytes(value).decode() if field.types[0] == gguf.GGUFValueType.STRING else value.item()


def test_gemma3_keys_norms_and_linear_rope_of_the_global_layers(tmp_path):
    """What transformers' reader does not read back, read with gguf's: the sliding layers' rope base, the
    global layers' linear rope scaling (Gemma 3 4B and up), every norm + 1, no output tensor."""
    rope = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    base = _gemma3_base(tmp_path / "base", rope_parameters=rope)
    out = tmp_path / "g3.gguf"
    assert main(["export", "--model", str(base), "--out", str(out)]) == 0
    reader = gguf.GGUFReader(str(out))
    assert _field(reader, "general.architecture") == "gemma3"
    assert _field(reader, "gemma3.rope.freq_base") == 1e6 and _field(reader, "gemma3.rope.freq_base_swa") == 1e4
    assert _field(reader, "gemma3.rope.scaling.type") == "linear" and _field(reader, "gemma3.rope.scaling.factor") == 8
    assert _field(reader, "gemma3.attention.sliding_window") == 8
    assert _field(reader, "gemma3.attention.key_length") == _field(reader, "gemma3.attention.value_length") == 256
    tensors = {t.name: torch.from_numpy(t.data.copy()) for t in reader.tensors}
    assert "output.weight" not in tensors
    from safetensors.torch import load_file

    stored = load_file(base / "model.safetensors")
    norms = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
             "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
             "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
    for hf, ours in norms.items():
        torch.testing.assert_close(tensors[f"blk.5.{ours}.weight"], stored[f"model.layers.5.{hf}.weight"] + 1)
    torch.testing.assert_close(tensors["output_norm.weight"], stored["model.norm.weight"] + 1)


def test_gemma3_all_global_layers_have_no_sliding_window(tmp_path):
    base = _gemma3_base(tmp_path / "base", layer_types=["full_attention"] * 6)
    assert main(["export", "--model", str(base), "--out", str(tmp_path / "g.gguf")]) == 0
    assert "gemma3.attention.sliding_window" not in gguf.GGUFReader(str(tmp_path / "g.gguf")).fields


@pytest.mark.parametrize(("config", "named"), [
    ({"layer_types": ["full_attention"] + ["sliding_attention"] * 5}, "layer_types"),
    ({"query_pre_attn_scalar": 100}, "query_pre_attn_scalar"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                          "sliding_attention": {"rope_type": "default", "rope_theta": 20000.0}}},
     "sliding layers' rope"),
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
])
def test_gemma3_that_llama_cpp_would_run_otherwise_is_refused(tmp_path, capsys, config, named):
    base = _gemma3_base(tmp_path / "base", **config)
    assert main(["export", "--model", str(base), "--out", str(tmp_path / "g.gguf")]) == 2
    err = capsys.readouterr().err
    assert named in err and "config.json" in err and "llama.cpp's gemma3" in err
    assert not (tmp_path / "g.gguf").exists()


def test_gemma3_vision_checkpoint_gives_its_text_model_only(tmp_path, caplog):
    base, _ = make_case(tmp_path, "gemma3", "gemma")
    with caplog.at_level("WARNING", logger="shardtune"):
        assert main(["export", "--model", str(base), "--out", str(tmp_path / "g.gguf")]) == 0
    names = {t.name for t in gguf.GGUFReader(str(tmp_path / "g.gguf")).tensors}
    assert names and all(n.startswith(("blk.", "token_embd.", "output_norm.")) for n in names), names
    assert len([n for n in names if n.startswith("blk.")]) == 6 * 13
    assert "vision tower and projector" in caplog.text
