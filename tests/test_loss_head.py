"""The loss head scores each target token without the full logits, and equals the full-logits path:
log-probabilities and gradients, for plain, tied, softcapped and scaled heads, in several chunks and
vocabulary blocks (FSDP2's row-sharded head), and falls back where it cannot score chunk by chunk."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shardtune.model import head
from shardtune.model.head import Transform
from shardtune.train import loss_head, target_logprobs
from shardtune.train.data.records import IGNORE


def _model(arch: str = "llama", tied: bool = False, **overrides):
    from transformers import AutoModelForCausalLM

    from tiny import tiny_config

    torch.manual_seed(0)
    if arch == "gemma2":
        from transformers import Gemma2Config

        cfg = Gemma2Config(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=8, final_logit_softcapping=3.0,
                           attn_implementation="eager")
    elif arch == "granite":
        from transformers import GraniteConfig

        cfg = GraniteConfig(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, logits_scaling=4.0)
    else:
        cfg = tiny_config(arch, tied)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    for table in (model.get_input_embeddings(), model.get_output_embeddings()):
        table.requires_grad_(False)  # frozen, as under LoRA
    return model


def _batch(model, rows: int = 3, width: int = 17, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (rows, width), generator=g)
    targets = torch.randint(0, model.config.vocab_size, (rows, width), generator=g)
    targets[:, -1] = IGNORE
    targets[0, :5] = IGNORE
    return {"input_ids": ids}, targets


def _reference(model, inputs, targets):
    logits = model(**inputs).logits.float()
    logps = F.log_softmax(logits, dim=-1).gather(-1, targets.clamp(min=0)[..., None]).squeeze(-1)
    return torch.where(targets != IGNORE, logps, 0.0)


def want_logits(model, inputs):
    with torch.no_grad():
        return model(**inputs).logits.float()


def _grads(model, loss):
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None and "lm_head" not in n
            and "embed" not in n}


@pytest.mark.parametrize("arch,tied", [("llama", False), ("llama", True), ("gpt2", True), ("qwen2", False),
                                       ("gemma2", True), ("granite", False)])
def test_scores_and_gradients_equal_the_full_logits(arch, tied):
    model = _model(arch, tied)
    inputs, targets = _batch(model)
    weights = torch.rand(targets.shape)  # an objective's arbitrary per-token weights
    want = _reference(model, inputs, targets)
    want_grads = _grads(model, -(want * weights).sum())
    assert loss_head.install(model, chunk=4)  # 51 tokens: 13 chunks
    # every position scored, and only those with a target, as the batches hand them (Forward.scored)
    for scored in (None, (targets.reshape(-1) != IGNORE).nonzero().squeeze(1)):
        got = loss_head.score(model, inputs, targets, scored=scored)
        torch.testing.assert_close(got.logps, want, rtol=1e-5, atol=1e-5)
        assert torch.equal(got.correct, (want_logits(model, inputs).argmax(-1) == targets) & (targets != IGNORE))
        got_grads = _grads(model, -(got.logps * weights).sum())
        assert set(got_grads) == set(want_grads) and want_grads
        for name, g in want_grads.items():
            torch.testing.assert_close(got_grads[name], g, rtol=1e-4, atol=1e-6, msg=name)
    with torch.no_grad():  # the same model still generates: logits when nothing is scored
        torch.testing.assert_close(model(**inputs).logits.float().log_softmax(-1).gather(
            -1, targets.clamp(min=0)[..., None]).squeeze(-1).where(targets != IGNORE, 0.0), want)


def test_token_accuracy_is_the_argmax():
    model = _model()
    inputs, targets = _batch(model)
    with torch.no_grad():
        best = model(**inputs).logits.argmax(-1)
    targets = torch.where(torch.rand(targets.shape) < 0.5, best, targets)
    targets[0, :5] = IGNORE
    loss_head.install(model, chunk=5)
    got = loss_head.score(model, inputs, targets)
    assert torch.equal(got.correct, (best == targets) & (targets != IGNORE))
    assert got.correct.sum() > 0


def test_vocabulary_blocks_merge_to_the_whole_head():
    """The online log-sum-exp over blocks (FSDP2's row-sharded head gives one block per rank), with
    blocks of uneven size, equals one block — values, accuracy and gradients."""
    torch.manual_seed(0)
    weight = torch.randn(50, 8)
    hidden = torch.randn(2, 7, 8, requires_grad=True)
    targets = torch.randint(0, 50, (2, 7))
    targets[1, 3] = IGNORE
    cuts = [0, 7, 30, 31, 50]

    def blocks():
        return iter([(a, weight[a:b]) for a, b in zip(cuts, cuts[1:])])

    t = Transform(softcap=2.0)
    got, correct = target_logprobs.TargetLogProbs.apply(hidden, targets, blocks, None, t, 3, False)
    (got * torch.arange(14.0).view(2, 7)).sum().backward()
    g_blocks = hidden.grad.clone()
    hidden.grad = None
    z = 2.0 * torch.tanh((hidden @ weight.T) / 2.0)
    want = z.log_softmax(-1).gather(-1, targets.clamp(min=0)[..., None]).squeeze(-1).where(targets != IGNORE, 0.0)
    (want * torch.arange(14.0).view(2, 7)).sum().backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(g_blocks, hidden.grad, rtol=1e-4, atol=1e-6)
    assert torch.equal(correct, (z.argmax(-1) == targets) & (targets != IGNORE))


def test_bf16_scores_match_the_full_logits_within_bf16():
    model = _model().to(torch.bfloat16)
    inputs, targets = _batch(model)
    want = _reference(model, inputs, targets)
    loss_head.install(model)
    got = loss_head.score(model, inputs, targets)
    assert got.logps.dtype == torch.float32
    torch.testing.assert_close(got.logps, want, rtol=2e-2, atol=2e-2)


def test_a_trained_head_falls_back_to_the_full_logits():
    model = _model()
    model.lm_head.weight.requires_grad_(True)
    assert not loss_head.install(model)
    inputs, targets = _batch(model)
    torch.testing.assert_close(loss_head.score(model, inputs, targets).logps, _reference(model, inputs, targets),
                               rtol=1e-5, atol=1e-5)


def test_an_unknown_transformation_after_the_head_falls_back(monkeypatch):
    model = _model()
    monkeypatch.setattr(head.inspect, "getsource", lambda obj: "logits = self.lm_head(h)\n"
                        "        logits = logits.clamp(-3, 3)\n        return logits")
    assert not loss_head.install(model)
