"""--packing: records share sequences, yet every token's loss and every gradient equal the padded ones."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from shardtune.train.data.batch import Batcher, Layout, sequence_sums
from shardtune.train.data.pack import block_causal_mask, forwards_per_rank, pack_rows
from shardtune.train.data.records import IGNORE, Example

from dist_utils import finetune_on_ranks
from tiny import instruction_records, make_model, make_run_dir, run_options


def test_rows_hold_every_record_once_within_capacity_deterministically():
    lengths = [5, 17, 3, 9, 12, 1, 16, 8, 8]
    rows = pack_rows(lengths, 20)
    assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in row) <= 20 for row in rows)
    assert len(rows) == 5 and rows == pack_rows(lengths, 20)  # ceil(79 / 20) = 4 is the bound; FFD uses 5
    with pytest.raises(ValueError, match="30 tokens"):
        pack_rows([30], 20)


def test_records_spread_over_the_rows_so_that_forwards_carry_little_padding():
    # First fit: rows of 510, 460 and 75 tokens, a forward 3 x 510 wide (fill 0.68); spread: 375 wide.
    lengths = [200, 180, 130, 130, 120, 110, 100, 75]
    rows = pack_rows(lengths, 512)
    widths = [sum(lengths[i] for i in row) for row in rows]
    assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
    assert len(rows) == 3 and max(widths) == 375 and widths == sorted(widths, reverse=True)
    # Spreading would overfill a row (5 + 3 | 4 + 3 + 3 = 10 > 9): first fit's rows stay.
    rows = pack_rows([5, 4, 3, 3, 3], 9)
    assert len(rows) == 2 and all(sum([5, 4, 3, 3, 3][i] for i in row) <= 9 for row in rows)


def test_every_rank_runs_the_same_number_of_forwards():
    examples = [Example([1] * n, [1] * n) for n in (30, 30, 30, 30, 2, 2, 2, 2)]
    plans = forwards_per_rank([[0, 1, 2, 3], [4, 5, 6, 7]], lambda i: len(examples[i].input_ids), capacity=32,
                              rows_per_forward=1)
    assert [len(p) for p in plans] == [4, 4]
    assert plans[1][0] == [[4, 5, 6, 7]] and plans[1][1:] == [[], [], []]  # padded with empty forwards
    for attention in ("shardtune", "sdpa"):
        batcher = Batcher(Layout(examples, 1, 32, 0, torch.device("cpu"), attention, torch.float32))
        empty = batcher.packed([])
        assert empty.real_tokens == 0 and empty.items == [] and (empty.targets == IGNORE).all()
        assert empty.scored is not None and empty.scored.numel() == 0  # the head scores nothing
        assert (empty.owners == -1).all() and empty.inputs["input_ids"].numel() == 1


def test_mask_keeps_records_apart_and_padding_to_itself():
    segments = torch.tensor([[0, 0, 1, 1, 1, -1]])
    allowed = block_causal_mask(segments, torch.float32)[0, 0] == 0
    expected = torch.tensor([
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [0, 0, 1, 0, 0, 0],
        [0, 0, 1, 1, 0, 0],
        [0, 0, 1, 1, 1, 0],
        [0, 0, 0, 0, 0, 1],
    ], dtype=torch.bool)
    assert torch.equal(allowed, expected)


def _records(tok, n: int) -> list[Example]:
    from shardtune.train.data.sft import tokenize

    return [tokenize(tok, r, 128)[0] for r in instruction_records(n, seed=5)]


def test_a_packed_step_reads_no_device_value_on_the_host(tmp_path):
    """The meta device stands for the GPU: a value read back from it (``.tolist()``, ``.item()``, ``bool``)
    raises, where on a GPU it is a host sync. The varlen layouts (flash's, shardtune's) get their record
    lengths as host integers, and shardtune's attention splits by them: the batch, the forward and the
    backward read nothing back (the packed batch once read its segments back, in every forward)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from shardtune.model.attention import use_shardtune_attention
    from shardtune.train import loss_head

    path = make_model(tmp_path / "llama", "llama")
    examples = _records(AutoTokenizer.from_pretrained(path), 7)
    rows = pack_rows([len(e.input_ids) for e in examples], 160)
    meta = torch.device("meta")
    for impl in ("flash_attention_2", "shardtune"):
        fwd = Batcher(Layout(examples, 1, 160, 0, meta, impl, torch.float32)).packed(rows)
        assert all(v.is_meta for v in fwd.inputs.values() if isinstance(v, torch.Tensor))
        assert {k: v for k, v in fwd.inputs.items() if not isinstance(v, torch.Tensor)}  # lengths on the host
    with meta:
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), attn_implementation="sdpa",
                                                 dtype=torch.float32)
    assert use_shardtune_attention(model) == "shardtune"
    loss_head.install(model)
    loss_head.score(model, fwd.inputs, fwd.targets, scored=fwd.scored).logps.sum().backward()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
@pytest.mark.parametrize("attention", ["shardtune", "sdpa", "eager"])
def test_packed_token_losses_and_gradients_equal_padded(tmp_path, arch, attention):
    """Packed records score exactly as padded ones: no token sees another record, positions restart."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shardtune.model.attention import use_shardtune_attention
    from shardtune.train import loss_head

    path = make_model(tmp_path / arch, arch)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager" if attention == "eager" else "sdpa",
                                                 dtype=torch.float32)
    impl = use_shardtune_attention(model) if attention == "shardtune" else attention
    assert impl == attention
    loss_head.install(model)
    examples = _records(tok, 7)
    batcher = Batcher(Layout(examples, 1, 160, 0, torch.device("cpu"), impl, torch.float32))

    def scored(fwd):
        model.zero_grad()
        logps = loss_head.score(model, fwd.inputs, fwd.targets, scored=fwd.scored).logps  # as the recipe scores
        per_record = dict(zip(fwd.items, sequence_sums(logps, fwd).tolist()))
        logps.sum().backward()
        return per_record, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    padded = batcher.padded(list(range(7)))
    assert ("attention_mask" in padded.inputs) == (attention != "shardtune")  # causal needs no padding mask
    want, want_grads = scored(padded)
    rows = pack_rows([len(e.input_ids) for e in examples], 160)
    assert len(rows) < len(examples)  # records really share rows
    packed = batcher.packed(rows)
    # shardtune's attention: one row, no mask at all; others: a block mask per row
    assert ("attention_mask" in packed.inputs) == (attention != "shardtune")
    assert packed.inputs["input_ids"].size(0) == (1 if attention == "shardtune" else len(rows))
    got, got_grads = scored(packed)
    assert set(got) == set(range(7))
    for i in range(7):
        assert got[i] == pytest.approx(want[i], rel=1e-5, abs=1e-5), i
    assert set(got_grads) == set(want_grads)
    for n, g in want_grads.items():
        torch.testing.assert_close(got_grads[n], g, rtol=1e-5, atol=1e-5, msg=n)
    assert packed.real_tokens == padded.real_tokens == sum(len(e.input_ids) for e in examples)


def test_a_model_whose_attention_cannot_keep_records_apart_is_refused(tmp_path):
    from transformers import AutoModelForCausalLM

    from shardtune.config import ConfigError
    from shardtune.train.data.pack import check_packing

    model = AutoModelForCausalLM.from_pretrained(make_model(tmp_path / "m", "llama"))
    check_packing(model)
    model.config._attn_implementation = "flex_attention"
    with pytest.raises(ConfigError, match="option 'packing'.*'flex_attention'.*supported: sdpa, eager, flash"):
        check_packing(model)


# --- whole runs ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return make_run_dir(tmp_path_factory.mktemp("packing"))


def _options(root: Path, out: str, **extra) -> dict:
    return run_options(root, out, **{"dtype": "fp32", "steps": 4, "batch-size": 8, "seq-len": 200, "lr": 1e-2,
                                     "warmup-steps": 1, "seed": 1, **extra})


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_packed_runs_train_like_padded_ones_on_any_split_and_resume_exactly(root):
    """On ranks started as plain torchrun starts them (finetune_on_ranks): what the runs compute is the subject."""
    import shutil

    padded = finetune_on_ranks(_options(root, "padded", strategy="single"), 1)
    packed = finetune_on_ranks(_options(root, "packed", strategy="single", packing=True), 1)
    # 2 ranks, one packed row per forward: ranks pack into different numbers of rows, so some run
    # empty forwards (they would hang otherwise), and gradients are reduced once per step.
    split = _options(root, "split", strategy="fsdp2", nproc=2, packing=True, **{"micro-batch-size": 1,
                                                                               "save-every": 2})
    two = finetune_on_ranks(split, 2)
    runs = {"padded": _metrics(root / "padded"), "packed": _metrics(root / "packed"), "split": _metrics(root / "split")}
    for name in ("packed", "split"):
        for key in ("loss", "grad_norm"):  # the loss rule holds however the batch is packed and split
            torch.testing.assert_close(torch.tensor([m[key] for m in runs[name]]),
                                       torch.tensor([m[key] for m in runs["padded"]]), rtol=1e-5, atol=1e-6)
        assert [m["tokens"] for m in runs[name]] == [m["tokens"] for m in runs["padded"]]  # real tokens only
    assert packed["tokens"] == padded["tokens"] == two["tokens"]
    assert packed["packing"] and not padded["packing"]
    assert 0 < padded["fill_ratio"] < packed["fill_ratio"] <= 1
    assert all(0 < m["fill_ratio"] <= 1 for m in runs["split"])

    # resumed from step 2 of the 2-rank packed run: the same steps 3 and 4, bit for bit
    out = root / "resumed"
    (out / "checkpoints").mkdir(parents=True)
    shutil.copytree(root / "split" / "checkpoints" / "step-2", out / "checkpoints" / "step-2")
    (out / "metrics.jsonl").write_text("".join((root / "split" / "metrics.jsonl").read_text().splitlines(True)[:2]))
    resumed = finetune_on_ranks({**split, "out": str(out), "resume": True}, 2)
    assert resumed["resumed_from_step"] == 2
    exact = ("step", "loss", "grad_norm", "tokens", "fill_ratio")
    assert [{k: m[k] for k in exact} for m in _metrics(out)] == [{k: m[k] for k in exact} for m in runs["split"]]
