"""Context parallelism (parallel/context_parallel.py, parallel/ulysses.py): the sequence cut over the
ranks of a CP group and Ulysses attention across the pieces equal one process in fp32, outputs and
q/k/v gradients, on packed rows whose records cross pieces (no record sees another: axolotl #3608),
unpacked rows, grouped-query attention, heads that do not divide the ranks, and padded lengths."""

from __future__ import annotations

import pytest
import torch

from shardtune.parallel.context_parallel import gather_sequence, local_piece, split_sequence, sum_over_group
from shardtune.parallel.ulysses import head_shares, record_attention, ulysses_attention

from dist_utils import run_ranks

IGNORE = -100
TOL = 1e-5


def packed_segments(rows: list[list[int]], width: int) -> torch.Tensor:
    """Record ids per token for rows of records of the given lengths, -1 on the padding after them."""
    out = torch.full((len(rows), width), -1)
    for r, lengths in enumerate(rows):
        at = 0
        for s, n in enumerate(lengths):
            out[r, at:at + n] = s
            at += n
    return out


def masked_attention(q, k, v, segments):
    """The one-process reference, written out: scores over the whole row, a mask allowing earlier
    tokens of the same record only (``segments`` None: one record per row), softmax."""
    b, h, w, d = q.shape
    k, v = (t.repeat_interleave(h // t.shape[1], dim=1) for t in (k, v))
    segments = torch.zeros(b, w, dtype=torch.long) if segments is None else segments
    allowed = (segments[:, :, None] == segments[:, None, :]) & torch.ones(w, w, dtype=torch.bool).tril()
    scores = (q @ k.transpose(-1, -2)) / d ** 0.5
    return scores.masked_fill(~allowed[:, None], float("-inf")).softmax(-1) @ v


def case(name, heads, kv_heads, segments, width, rows=2, dim=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    data = dict(q=torch.randn(rows, heads, width, dim, generator=g),
                k=torch.randn(rows, kv_heads, width, dim, generator=g),
                v=torch.randn(rows, kv_heads, width, dim, generator=g), segments=segments,
                # the upstream gradient, padding included (nonzero there: padding must still not count)
                up=torch.randn(rows, heads, width + 8, dim, generator=g))
    return name, data


# --- one process: the split, the head sharing, the reference itself ---------------------------------


def test_split_pads_to_the_ranks_and_cuts_contiguous_pieces():
    ids = torch.arange(1, 14).repeat(2, 1)  # 2 rows of 13 tokens: 3 pieces of 5, 2 padding tokens
    targets = torch.cat([ids[:, 1:], torch.full((2, 1), IGNORE)], 1)
    segments = packed_segments([[5, 6, 2], [3, 7]], 13)
    pieces = [split_sequence({"input_ids": ids, "targets": targets}, {"input_ids": 0, "targets": IGNORE}, 3, r,
                             segments) for r in range(3)]
    layout = pieces[0][0]
    assert (layout.width, layout.length, layout.piece) == (13, 15, 5)
    # every record and padding run is a segment, the added padding one of its own
    assert layout.bounds == ((0, 5, 11, 13, 15), (0, 3, 10, 13, 15))
    assert layout.cu_seq_lens().tolist() == [0, 5, 11, 13, 15, 18, 25, 28, 30] and layout.max_length == 7
    whole = torch.cat([p["targets"] for _, p in pieces], 1)
    assert torch.equal(whole[:, :13], targets) and whole[:, 13:].eq(IGNORE).all()
    assert torch.equal(torch.cat([p["input_ids"] for _, p in pieces], 1)[:, :13], ids)
    # unpacked rows: one record per row, padding its own segment
    layout, _ = split_sequence({"input_ids": ids}, {"input_ids": 0}, 2, 1)
    assert layout.bounds == ((0, 13, 14),) * 2 and layout.start == 7
    alone, _ = split_sequence({}, {}, 1, 0, segments)
    assert torch.equal(gather_sequence(local_piece(ids, alone), alone), ids)
    with pytest.raises(ValueError, match="no padding value for targets"):
        split_sequence({"targets": targets}, {}, 2, 0)


@pytest.mark.parametrize("heads,kv,size,share,held", [
    (9, 3, 2, 5, 9),  # SmolLM2-135M on 2 ranks: 4 + 5 query heads, the middle kv head on both
    (9, 3, 4, 3, 5),  # on 4 ranks: a kv group (3 query heads) each, one rank idle
    (32, 8, 8, 4, 6),  # Llama-3.1-8B on 8: a group each
    (32, 8, 16, 2, 4),  # on 16: half a group each, every kv head on two ranks
    (4, 4, 2, 2, 6),
    (2, 1, 4, 1, 3),  # more ranks than heads
])
def test_head_shares_are_fastest_then_smallest(heads, kv, size, share, held):
    shares = head_shares(heads, kv, size)
    assert max(b - a for a, b in shares.q) == share and shares.most_heads == held
    assert shares.overhead == pytest.approx(share * size / heads - 1)
    assert shares.cuts[0] == 0 and shares.cuts[-1] == heads and list(shares.cuts) == sorted(shares.cuts)
    for (a, b), (ka, kb) in zip(shares.q, shares.kv):  # every query head's kv head is on its rank
        assert all(ka <= h // (heads // kv) < kb for h in range(a, b))


def test_record_attention_keeps_records_apart_and_the_check_would_see_a_leak():
    _, d = case("packed", 4, 2, packed_segments([[5, 6, 2], [3, 7]], 13), 13)
    segments = d["segments"]
    bounds = split_sequence({}, {}, 1, 0, segments)[0].bounds
    ours = record_attention(d["q"], d["k"], d["v"], bounds)
    assert (ours - masked_attention(d["q"], d["k"], d["v"], segments)).abs().max() < TOL
    # The reference is sensitive: attention across records (plain causal) is far from it.
    leak = masked_attention(d["q"], d["k"], d["v"], None)
    assert (leak - ours).abs().max() > 100 * TOL


# --- N ranks against one process ---------------------------------------------------------------------


def attention_on_ranks(rank: int, world_size: int, runs: list[tuple[int, list]]) -> dict:
    """For each ``(cp, cases)`` of ``runs``, each case on this rank's CP group of ``cp`` consecutive
    ranks (the DP groups take different data): this rank's piece of the output and q/k/v gradients."""
    import torch.distributed as dist

    from shardtune.runtime import distributed

    distributed.init_worker()
    out: dict = {}
    for cp, cases in runs:
        groups = [dist.new_group(list(range(g * cp, (g + 1) * cp))) for g in range(world_size // cp)]
        out.update(_cases_on_group(cases, groups[rank // cp], rank // cp, rank % cp))
    # A per-sequence sum whose terms lie on several ranks (DPO's log-probabilities), then a nonlinear
    # loss of it: every rank's terms get d loss / d sum once.
    terms = torch.tensor([1.0 + rank, 2.0 * rank], requires_grad=True)
    total = sum_over_group(terms.sum() * terms[0])
    (total ** 2).backward()
    out["sum_over_group"] = (total.detach(), terms.grad)
    distributed.teardown()
    return out


def _cases_on_group(cases: list, group, dp: int, cp_rank: int) -> dict:
    cp = group.size()
    out = {}
    for name, data in cases:
        d = data[dp % len(data)]
        rows, width = d["q"].shape[0], d["q"].shape[2]
        layout, _ = split_sequence({"ids": torch.zeros(rows, width)}, {"ids": 0}, cp, cp_rank, d["segments"])
        q, k, v = (local_piece(d[n], layout, 2).clone().requires_grad_() for n in "qkv")
        o = ulysses_attention(q, k, v, layout, group)
        up = d["up"][:, :, layout.start:layout.start + layout.piece]  # padding's upstream gradient too
        (o * up).sum().backward()
        out[name] = dict(o=o.detach(), q=q.grad, k=k.grad, v=v.grad,
                         whole=gather_sequence(o.detach(), layout, group, dim=2))
        if name == "packed":
            # axolotl #3608, directly: change the first record of row 0 (all on rank 0's piece);
            # the other records' outputs, on every rank, stay bit for bit the same.
            v2 = d["v"].clone()
            v2[0, :, :5] += 1
            o2 = ulysses_attention(q.detach(), k.detach(), local_piece(v2, layout, 2), layout, group)
            mask = local_piece(d["segments"], layout, 1, -2)[0] == 0
            out["leak"] = dict(others_same=torch.equal(o2[0, :, ~mask], o[0, :, ~mask].detach()),
                               own_changed=bool((o2[0, :, mask] != o[0, :, mask]).any()) if mask.any() else None)
    return out


def check_against_one_process(results: list, cases: list, cp: int) -> None:
    for name, data in cases:
        for dp in range(len(results) // cp):
            d = data[dp % len(data)]
            ranks = [results[dp * cp + r][name] for r in range(cp)]
            width = d["q"].shape[2]
            leaves = {n: d[n].clone().requires_grad_() for n in "qkv"}
            ref = masked_attention(leaves["q"], leaves["k"], leaves["v"], d["segments"])
            (ref * d["up"][:, :, :width]).sum().backward()
            got = torch.cat([r["o"] for r in ranks], 2)[:, :, :width]
            assert (got - ref).abs().max() < TOL, f"{name}: output"
            for n in "qkv":
                grad = torch.cat([r[n] for r in ranks], 2)[:, :, :width]
                assert (grad - leaves[n].grad).abs().max() < TOL, f"{name}: {n} gradient"
            assert torch.equal(ranks[0]["whole"], got), f"{name}: gather_sequence"


def two_rank_cases():
    packed = packed_segments([[5, 6, 2], [3, 7]], 13)  # width 13: padded to 14; records cross the cut at 7
    return [
        case("packed", 4, 4, packed, 13),
        case("unpacked", 4, 2, None, 12, seed=1),
        case("smollm_heads", 9, 3, packed, 13, seed=2),  # 9 query heads, 3 kv heads: shares of 4 and 5
        case("one_row_many_records", 2, 1, packed_segments([[1, 4, 2, 1, 5]], 13), 13, rows=1, seed=3),
    ]


def test_two_ranks_equal_one_process():
    cases = [(name, [d]) for name, d in two_rank_cases()]
    results = run_ranks(attention_on_ranks, 2, [(2, cases)])
    check_against_one_process(results, cases, 2)
    assert results[1]["leak"] == {"others_same": True, "own_changed": None}
    # sum_over_group against one process holding both ranks' terms
    terms = [torch.tensor([1.0 + r, 2.0 * r], requires_grad=True) for r in range(2)]
    total = sum(t.sum() * t[0] for t in terms)
    (total ** 2).backward()
    for r, (got, grad) in enumerate(r["sum_over_group"] for r in results):
        assert torch.equal(got, total.detach()) and torch.allclose(grad, terms[r].grad)
    assert results[0]["leak"] == {"others_same": True, "own_changed": True}


def test_four_ranks_and_two_by_two_equal_one_process():
    """CP = 4 on 4 processes (uneven shares, kv heads on two ranks, ranks without heads), then
    CP = 2 x DP = 2 with different data in each CP group."""
    cp4 = [("cp4_smollm_heads", [case("", 9, 3, packed_segments([[5, 6, 2], [3, 7]], 13), 13, seed=4)[1]]),
           ("cp4_half_groups", [case("", 8, 2, packed_segments([[9, 2], [4, 4, 3]], 11), 11, seed=6)[1]]),
           ("cp4_more_ranks_than_heads", [case("", 2, 1, packed_segments([[7, 3], [10]], 10), 10, seed=5)[1]])]
    two = two_rank_cases()
    cp2 = [(f"dp_{name}", [d, case("", d["q"].shape[1], d["k"].shape[1], d["segments"], d["q"].shape[2],
                                   rows=d["q"].shape[0], seed=10 + i)[1]])
           for i, (name, d) in enumerate(two[:2])]
    results = run_ranks(attention_on_ranks, 4, [(4, cp4), (2, cp2)])
    check_against_one_process(results, cp4, 4)
    check_against_one_process(results, cp2, 2)
