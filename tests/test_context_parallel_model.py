"""Context parallelism through a whole model: a tiny Llama whose attention is registered with
transformers' ``AttentionInterface`` and calls ``ulysses_attention``, its packed rows cut over 2
ranks, each scoring its own tokens, gives the loss and every parameter gradient of one process
running the model as shardtune does today (SDPA with the packed rows' block-causal 4-D mask)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shardtune.train.data.pack import block_causal_mask

from dist_utils import run_ranks
from tiny import tiny_config

IGNORE = -100
ATTENTION = "shardtune_cp_test"


def cp_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, cp_layout=None,
                 cp_group=None, **kwargs):
    """A transformers attention function: q/k/v ``(batch, heads, piece, dim)`` of this rank's piece."""
    from shardtune.parallel.ulysses import ulysses_attention

    assert attention_mask is None and dropout == 0.0
    out = ulysses_attention(query, key, value, cp_layout, cp_group, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def packed_batch(seed: int = 0) -> dict:
    """Two packed rows of records of uneven lengths (records cross the middle of the row), targets
    pre-shifted within each record, positions restarting per record, padding after the records."""
    g = torch.Generator().manual_seed(seed)
    rows, width = [[5, 6, 2], [3, 7]], 13
    ids = torch.randint(0, 256, (2, width), generator=g)
    segments = torch.full((2, width), -1)
    positions = torch.zeros(2, width, dtype=torch.long)
    for r, lengths in enumerate(rows):
        at = 0
        for s, n in enumerate(lengths):
            segments[r, at:at + n], positions[r, at:at + n] = s, torch.arange(n)
            at += n
    same_record = (segments[:, 1:] == segments[:, :-1]) & segments[:, 1:].ge(0)
    targets = torch.full_like(ids, IGNORE)
    targets[:, :-1] = torch.where(same_record, ids[:, 1:], IGNORE)
    return dict(input_ids=ids, position_ids=positions, targets=targets, segments=segments)


def model_of(state: dict, attention: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(tiny_config("llama", tied=False), attn_implementation=attention)
    model.load_state_dict(state)
    return model.float()


def loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE, reduction="sum")


def on_ranks(rank: int, world_size: int, state: dict, batch: dict) -> dict:
    import torch.distributed as dist
    from transformers import AttentionInterface

    from shardtune.parallel.context_parallel import split_sequence
    from shardtune.runtime import distributed

    distributed.init_worker()
    AttentionInterface.register(ATTENTION, cp_attention)
    model = model_of(state, ATTENTION)
    layout, piece = split_sequence({n: batch[n] for n in ("input_ids", "position_ids", "targets")},
                                   {"input_ids": 0, "position_ids": 0, "targets": IGNORE}, world_size, rank,
                                   batch["segments"])
    count = int(batch["targets"].ne(IGNORE).sum())  # the global count: every rank has the whole batch
    logits = model(input_ids=piece["input_ids"], position_ids=piece["position_ids"], cp_layout=layout,
                   cp_group=None).logits
    loss = loss_sum(logits, piece["targets"]) / count
    loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    for grad in grads.values():
        dist.all_reduce(grad)  # what FSDP's reduction over the CP ranks does
    total = loss.detach().clone()
    dist.all_reduce(total)
    distributed.teardown()
    return {"loss": total, "grads": grads}


def test_tiny_llama_on_two_ranks_equals_one_process():
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(tiny_config("llama", tied=False), attn_implementation="sdpa").float()
    with torch.no_grad():
        for p in reference.parameters():
            p.normal_(0, 0.2)  # as tests/tiny.py: logits that differ clearly between records
    state = {k: v.clone() for k, v in reference.state_dict().items()}
    batch = packed_batch()
    logits = reference(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                       attention_mask=block_causal_mask(batch["segments"], torch.float32)).logits
    loss = loss_sum(logits, batch["targets"]) / batch["targets"].ne(IGNORE).sum()
    loss.backward()

    results = run_ranks(on_ranks, 2, state, batch)
    for r in results:
        assert abs(float(r["loss"]) - loss.item()) < 1e-5
        for name, p in reference.named_parameters():
            assert (r["grads"][name] - p.grad).abs().max() < 1e-5, name
    # The comparison sees a leak: the same model letting packed records see each other (plain causal) differs.
    leaky = reference(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
    leaky_loss = loss_sum(leaky, batch["targets"]).item() / batch["targets"].ne(IGNORE).sum().item()
    assert abs(leaky_loss - loss.item()) > 1e-3
