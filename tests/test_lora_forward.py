"""LoRA's fused forward (model/lora_forward.py): the same outputs and gradients as peft's own forward, which
every layer it does not cover still runs."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from shardtune.config import LoraConfig
from shardtune.model.lora import inject_lora
from shardtune.model.lora_forward import fuse_lora_forward
from shardtune.runtime.compat.peft_layers import adapters_disabled

from tiny import tiny_config


def _models(arch: str = "llama", dtype: torch.dtype = torch.float32, std: float = 0.3,
            **lora: object) -> tuple[nn.Module, nn.Module]:
    """A tiny model with peft's LoRA (A and B random of ``std``, so the adapter changes every layer), and a copy
    of it fused."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(tiny_config(arch, tied=False)).to(dtype)
    options = {"r": 4, "lora_alpha": 12, "target_modules": "all-linear", **lora}
    peft_model = get_peft_model(base, PeftLoraConfig(task_type="CAUSAL_LM", **options))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.data = p.data.float()  # as the recipe keeps them
                p.normal_(0, std)
    fused = copy.deepcopy(peft_model)
    assert fuse_lora_forward(fused) > 0
    return peft_model, fused


def _run(model: nn.Module, ids: torch.Tensor, seed: int = 1) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad()
    torch.manual_seed(seed)  # the same dropout masks in both
    logits = model(input_ids=ids).logits
    logits.float().square().mean().backward()
    return logits.detach().float(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(got.float() - want.float()) / torch.linalg.vector_norm(want.float()))


def _close_in_bf16(peft_model: nn.Module, fused: nn.Module, ids: torch.Tensor) -> None:
    """Within bf16's rounding (the fused sum rounds once where peft rounds three times; adapters of 0.05 so
    that two random layers do not amplify it): logits within 3% of their norm, while the adapter moves them
    by far more, and every gradient within 5%."""
    want, want_grads = _run(peft_model, ids)
    got, got_grads = _run(fused, ids)
    with torch.no_grad(), adapters_disabled(peft_model):
        base = peft_model(input_ids=ids).logits
    assert _relative(got, want) < 0.03 < 0.3 < _relative(base, want)
    assert want_grads.keys() == got_grads.keys()
    for name in want_grads:
        assert got_grads[name].dtype == torch.float32  # into the fp32 parameter, as FSDP's mixed precision
        assert _relative(got_grads[name], want_grads[name]) < 0.05, name


def _addmm_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    addmm = torch.addmm

    def counted(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(1)
        return addmm(*args, **kwargs)
    monkeypatch.setattr(torch, "addmm", counted)
    return calls


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("dropout", [0.0, 0.25])
def test_fused_forward_matches_peft_outputs_and_gradients(arch: str, dropout: float,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    peft_model, fused = _models(arch, lora_dropout=dropout)
    ids = torch.randint(0, 256, (2, 9))
    want, want_grads = _run(peft_model.train(), ids)
    calls = _addmm_calls(monkeypatch)
    got, got_grads = _run(fused.train(), ids)
    layers = sum(type(m).__name__ == "Linear" and hasattr(m, "lora_A") for m in fused.modules())
    assert len(calls) >= layers > 0  # every LoRA layer took the fused path (gpt2's Conv1D bases use addmm too)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # rounding of the sum
    assert got_grads.keys() == want_grads.keys() and any("lora_A" in n for n in got_grads)
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], rtol=1e-4, atol=1e-7, msg=name)


def test_fused_forward_adds_in_the_adapter_dtype_like_peft() -> None:
    """A bf16 base with fp32 adapter weights (the recipe's layout): summed in fp32, returned in bf16."""
    peft_model, fused = _models(dtype=torch.bfloat16, std=0.05)
    _close_in_bf16(peft_model, fused, torch.randint(0, 256, (2, 7)))


def test_fused_forward_reads_the_weights_cast_for_compute(monkeypatch: pytest.MonkeyPatch) -> None:
    """single and ddp cast fp32 adapter weights to the compute dtype for a forward (parallel/compute_dtype.py):
    the fused forward, which reads lora_B's weight without calling it, gets the cast copy as peft's call does."""
    from shardtune.parallel.compute_dtype import compute_trainable_in

    peft_model, fused = _models(dtype=torch.bfloat16, std=0.05)
    for model in (peft_model, fused):
        compute_trainable_in(model, torch.bfloat16)
    calls = _addmm_calls(monkeypatch)
    _close_in_bf16(peft_model, fused, torch.randint(0, 256, (2, 7)))
    assert calls


def test_disabled_adapters_and_dora_run_peft_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    peft_model, fused = _models()
    ids = torch.randint(0, 256, (1, 6))
    calls = _addmm_calls(monkeypatch)
    with torch.no_grad(), adapters_disabled(fused), adapters_disabled(peft_model):
        torch.testing.assert_close(fused(input_ids=ids).logits, peft_model(input_ids=ids).logits, rtol=0, atol=0)
    assert not calls
    dora, fused_dora = _models(use_dora=True)
    with torch.no_grad():
        torch.testing.assert_close(fused_dora(input_ids=ids).logits, dora(input_ids=ids).logits, rtol=0, atol=0)
    assert not calls


def test_inject_lora_fuses_every_lora_layer() -> None:
    from peft.tuners.lora.layer import Linear
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_config("llama", tied=False))
    peft_model, _ = inject_lora(model, LoraConfig(r=4, alpha=8, targets="all-linear"), seed=0)
    layers = [m for m in peft_model.modules() if isinstance(m, Linear)]
    assert len(layers) == 2 * 7
    assert all(type(m) is not Linear and type(m).__name__ == "Linear" for m in layers)
    assert fuse_lora_forward(peft_model) == 0  # once only


def test_adapter_modules_wrapped_after_a_forward_run_peft_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    """FSDP1 wraps lora_A and lora_B in units of their own, which gather only when called: a layer whose
    adapter modules changed after its first forward reads them no more (the check is made at each call)."""
    peft_model, fused = _models()
    ids = torch.randint(0, 256, (1, 6))
    with torch.no_grad():
        fused(input_ids=ids)
        for layer in fused.modules():
            if hasattr(layer, "lora_B") and hasattr(layer, "base_layer"):
                layer.lora_B["default"] = nn.Sequential(layer.lora_B["default"])  # a wrapper, as FSDP1's
        calls = _addmm_calls(monkeypatch)
        got = fused(input_ids=ids).logits
    assert not calls  # no layer read B's weight around its wrapper
    torch.testing.assert_close(got, peft_model(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
