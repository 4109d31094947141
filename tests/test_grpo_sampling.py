"""Seeded sampling of completions: the same completions however the prompts are batched (so however many ranks
share them), stop at EOS, truncation flagged, and generate's greedy answers and warpers."""

from __future__ import annotations

import pytest
import torch

from shardtune.config import ConfigError
from shardtune.train.sampling import (
    SamplingSettings,
    completion_seed,
    hf_cache,
    hf_next_logits,
    sample,
    warp,
)

from tiny import make_model

pytestmark = pytest.mark.usefixtures("one_thread")
EOS, PAD = 257, 258
PROMPTS = [[60, 97, 98, 99], [61, 100], [62, 101, 102, 103, 104, 105, 106], [63]]
G = 3
# (prompt index in the dataset, completion index): what seeds each completion's stream
KEYS = [(p, c) for p in (10, 11, 12, 13) for c in range(G)]
ROWS = [PROMPTS[p - 10] for p, _ in KEYS]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = make_model(tmp_path_factory.mktemp("sampling") / "model", chat_template=False)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def run(model, rows, keys, settings, seed=0, step=0, eos_bias=0.0):
    """``eos_bias``: added to EOS's logit (a random tiny model hardly ever says EOS)."""
    model_logits = hf_next_logits(model)

    def next_logits(ids, mask, positions, cache):
        logits = model_logits(ids, mask, positions, cache)
        logits[:, EOS] += eos_bias
        return logits
    with torch.no_grad():
        return sample(next_logits, rows, keys, settings, seed, step, hf_cache(model))


def settings(**kw) -> SamplingSettings:
    return SamplingSettings(**{"max_new_tokens": 12, "eos_ids": (EOS,), "pad_id": PAD, "temperature": 1.0, **kw})


# the knobs, and an EOS bias under which some of the 12 completions end within 12 tokens and some are cut
@pytest.mark.parametrize("knobs,bias", [({}, 3.0), ({"temperature": 0.7, "top_k": 20, "top_p": 0.9}, 0.5)])
def test_completions_do_not_depend_on_how_the_prompts_are_batched(tiny_model, knobs, bias):
    s = settings(**knobs)
    whole = run(tiny_model, ROWS, KEYS, s, eos_bias=bias)
    assert 0 < sum(c.truncated for c in whole) < len(whole)
    assert all(c.ids[-1] == EOS and EOS not in c.ids[:-1] for c in whole if not c.truncated)
    assert all(len(c.ids) == 12 and EOS not in c.ids for c in whole if c.truncated)
    two_ranks = run(tiny_model, ROWS[:5], KEYS[:5], s, eos_bias=bias) + \
        run(tiny_model, ROWS[5:], KEYS[5:], s, eos_bias=bias)
    reordered = run(tiny_model, ROWS[::-1], KEYS[::-1], s, eos_bias=bias)[::-1]
    one_by_one = [run(tiny_model, [r], [k], s, eos_bias=bias)[0] for r, k in zip(ROWS, KEYS)]
    for other in (two_ranks, reordered, one_by_one):
        assert [c.ids for c in other] == [c.ids for c in whole]
        assert [c.truncated for c in other] == [c.truncated for c in whole]
    # completions of one prompt differ from each other, and the seed and step change them
    assert len({tuple(c.ids) for c in whole[:G]}) == G
    assert [c.ids for c in run(tiny_model, ROWS, KEYS, s, step=1, eos_bias=bias)] != [c.ids for c in whole]
    assert [c.ids for c in run(tiny_model, ROWS, KEYS, s, seed=1, eos_bias=bias)] != [c.ids for c in whole]


@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma3", "qwen2", "phi3", "gpt2", "falcon"])
def test_greedy_is_generate_s_greedy(tiny_model, arch, tmp_path):
    """temperature 0 through the KV cache: the tokens ``generate`` picks (through its own growing cache), on
    left-padded prompts of different lengths (positions count real tokens only), for each kind of attention and
    cache: sliding windows shorter than the rows (Mistral), sliding and global layers (Gemma 3), ALiBi-less
    learned positions (GPT-2), Falcon's fused projections."""
    from transformers import AutoModelForCausalLM

    model = tiny_model if arch == "llama" else AutoModelForCausalLM.from_pretrained(
        make_model(tmp_path / arch, arch, chat_template=False), dtype=torch.float32).eval()
    got = run(model, PROMPTS, [(i, 0) for i in range(len(PROMPTS))], settings(temperature=0.0))
    for prompt, completion in zip(PROMPTS, got):
        with torch.no_grad():
            ref = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=12, eos_token_id=EOS,
                                      pad_token_id=PAD, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        expected = ref[0, len(prompt):].tolist()
        if EOS in expected:
            expected = expected[:expected.index(EOS) + 1]
        assert completion.ids == expected
        assert completion.truncated == (expected[-1] != EOS)


def test_stops_at_eos_flags_truncation_and_keeps_ranks_in_step():
    """A fake model: row 0 says EOS at its 3rd token, row 1 never. Row 0 stops (EOS kept), row 1 runs to the
    limit (truncated); once every row here is done, ``keep_going`` decides (another rank may be unfinished)."""
    calls = []

    def next_logits(ids, mask, positions, cache):
        calls.append((ids.shape, mask.shape, positions[:, -1].tolist()))
        logits = torch.zeros(ids.size(0), 300)
        logits[:, 5] = 10.0
        if len(calls) == 3:
            logits[0, EOS] = 100.0
        return logits

    out = sample(next_logits, [[1, 2, 3], [4]], [(0, 0), (1, 0)], settings(max_new_tokens=6, temperature=0.0), 0, 0,
                 new_cache=lambda tokens: None)
    assert out[0].ids == [5, 5, EOS] and not out[0].truncated
    assert out[1].ids == [5] * 6 and out[1].truncated
    assert calls[0] == (torch.Size([2, 3]), torch.Size([2, 3]), [2, 0])  # prefill, left-padded
    assert calls[1] == (torch.Size([2, 1]), torch.Size([2, 4]), [3, 1])  # then one token a step, positions per row
    assert len(calls) == 6  # the last token needs no forward

    calls.clear()
    steps = []
    out = sample(next_logits, [[1]], [(0, 0)], settings(max_new_tokens=6, temperature=0.0), 0, 0, lambda tokens: None,
                 keep_going=lambda unfinished: steps.append(unfinished) or len(steps) < 4)
    assert out[0].ids == [5, 5, EOS] and len(calls) == 4  # done after 3, one more step for the other ranks
    assert steps == [True, True, False, False]


def test_warp_is_generate_s_temperature_top_k_top_p():
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0)) * 3
    logits[0, :4] = logits[0, 4]  # ties at the k-th
    for t, k, p in [(0.7, 0, 1.0), (1.0, 10, 1.0), (1.3, 0, 0.8), (0.5, 5, 0.3), (1.0, 0, 1e-9)]:
        expected = TemperatureLogitsWarper(t)(None, logits.clone())
        if k:
            expected = TopKLogitsWarper(k)(None, expected)
        if p < 1:
            expected = TopPLogitsWarper(p)(None, expected)
        assert torch.equal(warp(logits, t, k, p), expected)


def test_draws_follow_the_distribution():
    """Inverse-CDF draws from the rows' streams: frequencies within a few standard errors of the probabilities."""
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().expand(1, 4)
    counts = torch.zeros(4)
    s = settings(temperature=1.0)
    from shardtune.train.sampling import completion_generator, pick

    for i in range(4000):
        counts[pick(logits, s, [completion_generator(0, 0, i, 0)])] += 1
    assert ((counts / 4000 - probs).abs() < 4 * (probs * (1 - probs) / 4000).sqrt()).all()


def test_seeds_and_settings():
    assert completion_seed(0, 0, 1, 0) != completion_seed(0, 0, 0, 1) != completion_seed(0, 1, 0, 0)
    assert completion_seed(3, 5, 7, 1) == completion_seed(3, 5, 7, 1) < 2 ** 63
    for bad, match in [({"top_p": 0.0}, "top_p"), ({"temperature": -1.0}, "temperature"), ({"top_k": -1}, "top_k"),
                       ({"max_new_tokens": 0}, "max_completion_length"), ({"eos_ids": ()}, "EOS")]:
        with pytest.raises(ConfigError, match=match):
            settings(**bad)


def test_no_prompts_or_an_empty_one_is_named():
    def next_logits(ids, mask, positions, cache):
        raise AssertionError("never called")

    for prompts, match in [([], "no prompts"), ([[3], []], "prompt #1 has no tokens")]:
        with pytest.raises(ValueError, match=match):
            sample(next_logits, prompts, [(i, 0) for i in range(len(prompts))], settings(), 0, 0, lambda tokens: None)


def widest_on_ranks(rank: int, world_size: int, rows: list[int]) -> str | int:
    from shardtune.runtime import distributed
    from shardtune.train.generation import widest_prompt

    worker = distributed.init_worker()
    try:
        return widest_prompt([[1] * (2 + rank + i) for i in range(rows[rank])], worker)
    except ValueError as err:
        return str(err)
    finally:
        distributed.teardown()


def test_lockstep_pads_to_every_ranks_widest_prompt_and_needs_as_many_rows_on_each():
    """In lockstep every forward must carry as many tokens on every rank (the exchanges rely on it): the prompts
    pad to every rank's widest, and a rank with another row count fails on every rank, named, not in a
    collective."""
    from dist_utils import run_ranks

    assert run_ranks(widest_on_ranks, 2, [2, 2]) == [4, 4]
    for found in run_ranks(widest_on_ranks, 2, [2, 3]):
        assert "every rank must sample as many rows" in found and "between 2 and 3" in found
