"""The long-context parts a step is made of: the tiled MLP, the activation-offload bookkeeping and the
attention without a square mask (sliding windows included) give the numbers of the plain model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shardtune.model import attention
from shardtune.parallel.activation_offload import Offloader
from shardtune.parallel.tiling import tile_mlps


def _model(arch: str = "llama", checkpointing: bool = False, **overrides):
    from transformers import AutoModelForCausalLM

    from tiny import tiny_config

    torch.manual_seed(0)
    cfg = tiny_config(arch, False)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


def _loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids).logits
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("checkpointing", [False, True])
def test_tiled_mlp_gives_the_same_loss_and_gradients(checkpointing):
    ids = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(0))
    model = _model(checkpointing=checkpointing)
    want, want_grads = _loss_and_grads(model, ids)
    assert tile_mlps(list(model.model.layers), 7) == 2  # 40 tokens: tiles of 7, the last of 5
    got, got_grads = _loss_and_grads(model, ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for n, g in want_grads.items():
        torch.testing.assert_close(got_grads[n], g, rtol=1e-4, atol=1e-6, msg=n)
    with pytest.raises(ValueError, match="at least one token"):
        tile_mlps(list(model.model.layers), 0)


def test_offloaded_saves_come_back_unchanged_once_each():
    """The offload bookkeeping, driven on a CPU with plain copies standing in for the transfers: every
    checkpointed layer input leaves and comes back, a tensor saved by several layers moves once, and
    the gradients are those of the run without offloading."""
    ids = torch.randint(0, 300, (2, 64), generator=torch.Generator().manual_seed(1))
    model = _model(checkpointing=True)
    want, want_grads = _loss_and_grads(model, ids)
    copies = []

    def copy(t, device):
        copies.append(t.shape)
        return t.detach().clone()

    offloader = Offloader(torch.device("cpu"), min_bytes=1, copy=copy)
    with offloader.hooks():
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=ids).logits
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
    saved = len(offloader.host)
    assert saved >= 2 and offloader.moved > 0  # at least each layer's input went out
    loss.backward()
    torch.testing.assert_close(loss.detach(), want)
    for n, p in model.named_parameters():
        if n in want_grads:
            torch.testing.assert_close(p.grad, want_grads[n], msg=n)
    assert not offloader.host and not offloader.back  # nothing outlives its use in backward
    assert len(copies) == 2 * saved  # out once and back once each, shared tensors included


def test_a_tensor_laid_where_a_moved_one_was_is_another_tensor():
    """Once a saved tensor has moved out its memory is freed, and the next tensor of its size may get the
    same address (a GPU's caching allocator hands it on at once): backward must get each one's own values.
    Both tensors here lie on one buffer, so they have the same address, shape and dtype for sure."""
    memory = bytearray(4 * 8 * 4)
    w = torch.randn(4, 8, requires_grad=True)
    offloader = Offloader(torch.device("cpu"), min_bytes=1, copy=lambda t, device: t.detach().clone())
    with offloader.hooks():
        first = torch.frombuffer(memory, dtype=torch.float32).view(4, 8).fill_(2.0)
        y = w * first  # saved for w's gradient, then moved out: nothing else holds it
        del first
        second = torch.frombuffer(memory, dtype=torch.float32).view(4, 8).fill_(3.0)
        y = y + w * second
    y.sum().backward()
    torch.testing.assert_close(w.grad, torch.full((4, 8), 5.0))
    assert offloader.moved == 2 * 4 * 8 * 4


def test_offloading_is_not_installed_on_a_cpu():
    from shardtune.parallel.activation_offload import offloaded

    with offloaded(torch.device("cpu"), enabled=True) as offloader:
        assert offloader is None


def _packed_reference(model, ids, lengths):
    """Each record on its own through the model: what packed attention must equal."""
    outs, at = [], 0
    for n in lengths:
        outs.append(model(input_ids=ids[:, at:at + n]).logits)
        at += n
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize("window", [None, 5])
def test_packed_records_attend_only_within_themselves(window):
    """shardtune's attention on one row of records: each record as if alone (Qwen2 with a sliding window of
    5 tokens too: its blocks of queries see only their window)."""
    model = _model("qwen2", use_sliding_window=window is not None, sliding_window=window or 4096,
                   max_window_layers=0, layer_types=["sliding_attention" if window else "full_attention"] * 2)
    model.eval()
    lengths = (9, 14, 3, 11)
    ids = torch.randint(0, 300, (1, sum(lengths)), generator=torch.Generator().manual_seed(2))
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.no_grad():
        want = _packed_reference(model, ids, lengths)
        assert attention.use_shardtune_attention(model) == "shardtune"
        got = model(input_ids=ids, position_ids=positions, shardtune_lengths=lengths).logits
        alone = model(input_ids=ids[:, :9]).logits  # no lengths: one causal sequence
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(alone, want[:, :9], rtol=1e-4, atol=1e-5)


def test_live_bytes_counts_what_is_alive_at_once():
    from shardtune.runtime.compat import LiveBytes

    with LiveBytes() as live:
        a = torch.ones(1024)  # 4 KiB
        b = torch.ones(2048)  # 8 KiB: 12 KiB alive
        del a
        c = torch.ones(512)  # 2 KiB: 10 KiB alive
    assert (live.peak, live.live) == (12288, 10240)
    del b, c
    assert live.live == 0


@pytest.mark.parametrize("seq", [64, 256])
def test_planned_recomputed_backward_is_what_a_real_layer_holds(seq):
    """The planner's workspace under activation checkpointing: the most bytes one layer's recomputation and
    backward hold at once, traced on fake tensors, equals that of the real layer on real tensors."""
    from shardtune.model.footprint import _recomputed_backward_bytes, _saved_bytes
    from shardtune.model.structure import decoder_layers

    model = _model()
    model.config.use_cache = False  # as training builds it (model/meta.py)
    planned = _saved_bytes(model, 2, seq, torch.float32, torch.device("cpu")).backward
    layers = decoder_layers(model)
    inputs = {}
    hooks = [layer.register_forward_pre_hook(lambda m, a, k, i=i: inputs.__setitem__(i, (a, k)), with_kwargs=True)
             for i, layer in enumerate(layers)]
    with attention.shardtune_attention(model):
        model(input_ids=torch.randint(0, 100, (2, seq)))
        for h in hooks:
            h.remove()
        tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
        real = [_recomputed_backward_bytes(model, layer, tensors, *inputs[i]) for i, layer in enumerate(layers)]
    assert planned == max(real)
    assert planned > 2 * seq * model.config.intermediate_size * 4  # at least the MLP's gate and up outputs
