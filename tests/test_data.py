"""Records → tokens and labels (loss only where it should be), batch plans, the seeded sampler, collate."""

from __future__ import annotations

import json

import pytest
import torch

from shardtune.runplan import BatchError, BatchSplit
from shardtune.train.data.batch import Batcher, Layout, Sampler, collate
from shardtune.train.data.read import read_records
from shardtune.train.data.records import IGNORE, DataError, Example
from shardtune.train.data.sft import tokenize
from shardtune.train.data.tokenize import load_dataset

from tiny import instruction_records, make_tokenizer, write_jsonl

CHAT = {"messages": [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is red?"},
    {"role": "assistant", "content": "A colour."},
    {"role": "user", "content": "And blue?"},
    {"role": "assistant", "content": "Another colour."},
]}


@pytest.fixture(scope="module", params=[True, False], ids=["chat-template", "plain"])
def tok(request):
    return make_tokenizer(chat_template=request.param)


def target_spans(tok, ex: Example) -> list[str]:
    """The label tokens as text, one string per contiguous run of targets."""
    spans, run = [], []
    for ident, label in zip(ex.input_ids, ex.labels, strict=True):
        if label != IGNORE:
            assert label == ident  # a target is always the token at that position
            run.append(label)
        elif run:
            spans.append(tok.decode(run))
            run = []
    if run:
        spans.append(tok.decode(run))
    return spans


def end_of(tok, text: str) -> str:
    """What follows an assistant turn's text: the template's </s>, or the plain layout's blank line + eos."""
    return f"{text}</s>" if tok.chat_template else f"{text}\n\n</s>"


# --- the three record forms ---------------------------------------------------------------------

def test_instruction_record_trains_on_the_output_only(tok):
    record = {"instruction": "Reverse these words", "input": "alpha beta", "output": "beta alpha"}
    ex, cut = tokenize(tok, record, 512)
    assert not cut
    assert len(ex.input_ids) == len(ex.labels)
    spans = target_spans(tok, ex)
    assert spans == [end_of(tok, "beta alpha")]
    assert "Reverse" not in spans[0] and "alpha beta" not in spans[0]
    # The prompt is all there, just not a target.
    full = tok.decode(ex.input_ids)
    assert "Reverse these words" in full and "alpha beta" in full
    assert ex.targets == len(tok(spans[0], add_special_tokens=False)["input_ids"])
    if not tok.chat_template:
        assert ex.input_ids[0] == tok.bos_token_id and ex.labels[0] == IGNORE


def test_instruction_without_input(tok):
    ex, _ = tokenize(tok, {"instruction": "Say hi", "output": "hi"}, 512)
    assert target_spans(tok, ex) == [end_of(tok, "hi")]
    assert "Say hi" in tok.decode(ex.input_ids)


def test_messages_record_trains_on_every_assistant_turn_only(tok):
    ex, cut = tokenize(tok, CHAT, 512)
    assert not cut
    spans = target_spans(tok, ex)
    if tok.chat_template:
        assert spans == ["A colour.</s>", "Another colour.</s>"]
    else:  # the plain layout ends only the conversation with eos
        assert spans == ["A colour.\n\n", "Another colour.\n\n</s>"]
    targets = "".join(spans)
    for not_a_target in ("What is red?", "And blue?", "Be brief."):
        assert not_a_target not in targets
        assert not_a_target in tok.decode(ex.input_ids)


def test_messages_record_matches_the_rendered_conversation():
    tok = make_tokenizer(chat_template=True)
    ex, _ = tokenize(tok, CHAT, 512)
    assert tok.decode(ex.input_ids) == tok.apply_chat_template(CHAT["messages"], tokenize=False)


def test_text_record_trains_on_every_token(tok):
    ex, cut = tokenize(tok, {"text": "the quick brown fox"}, 512)
    assert not cut
    assert ex.labels == ex.input_ids
    assert ex.input_ids[-1] == tok.eos_token_id
    assert tok.decode(ex.input_ids) == "the quick brown fox</s>"
    assert ex.targets == len(ex.input_ids) - 1  # the first token is never predicted


# --- truncation ---------------------------------------------------------------------------------

def test_truncation_is_counted_and_cut_to_seq_len(tmp_path, tok):
    records = [{"text": "x" * 100}, {"text": "short"}, {"instruction": "i", "output": "o" * 100}]
    path = write_jsonl(tmp_path / "d.jsonl", records)
    ds = load_dataset(path, tok, seq_len=40)
    assert ds.truncated == 2
    assert ds.without_targets == 0
    assert len(ds.examples) == 3
    assert all(len(e.input_ids) <= 40 and len(e.labels) == len(e.input_ids) for e in ds.examples)
    assert len(ds.examples[0].input_ids) == 40


def test_records_without_targets_after_truncation_are_dropped_and_counted(tmp_path, tok):
    long_prompt = {"instruction": "p" * 200, "output": "answer"}
    path = write_jsonl(tmp_path / "d.jsonl", [long_prompt, {"text": "kept"}, long_prompt])
    ds = load_dataset(path, tok, seq_len=32)
    assert ds.without_targets == 2
    assert ds.truncated == 2
    assert len(ds.examples) == 1
    assert tok.decode(ds.examples[0].input_ids) == "kept</s>"


def test_token_ids_beyond_the_vocabulary_name_the_record(tmp_path, tok):
    # Checked once at load, on every rank before any collective: the sharded lookup no longer checks
    # (that was a host sync per micro-batch, and one rank could raise while the others waited).
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "ok"}, {"text": "no"}])
    ids = [e.input_ids for e in load_dataset(path, tok, seq_len=32).examples]
    assert len(load_dataset(path, tok, seq_len=32, vocab_size=max(map(max, ids)) + 1).examples) == 2
    bad = max(ids[1]) + 1 if max(ids[0]) > max(ids[1]) else max(ids[0])  # only one record reaches it
    line = 1 if max(ids[0]) >= bad else 2
    with pytest.raises(DataError, match=rf"d.jsonl:{line}: token id \d+ is outside the model's {bad} embedding rows"):
        load_dataset(path, tok, seq_len=32, vocab_size=bad)


def test_no_record_with_targets_is_an_error(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", [{"instruction": "p" * 200, "output": "answer"}])
    with pytest.raises(DataError, match="no record has a target token within --seq-len 16"):
        load_dataset(path, tok, seq_len=16)


# --- files --------------------------------------------------------------------------------------

def test_json_array_file_equals_jsonl(tmp_path, tok):
    records = instruction_records(6) + [CHAT, {"text": "plain text"}]
    array = tmp_path / "d.json"
    array.write_text(json.dumps(records, indent=2))
    lines = write_jsonl(tmp_path / "d.jsonl", records)
    assert [r for _, r in read_records(array)] == records
    a, b = load_dataset(array, tok, 256), load_dataset(lines, tok, 256)
    assert a.examples == b.examples and len(a.examples) == len(records)


def test_blank_lines_are_skipped_and_line_numbers_kept(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "a"}\n\n{"text": "b"}\n')
    assert read_records(path) == [(1, {"text": "a"}), (3, {"text": "b"})]


@pytest.mark.parametrize("record, message", [
    ({"messages": []}, "'messages' must be a non-empty list"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "no message has role 'assistant'"),
    ({"messages": [{"role": "user"}]}, r"messages\[0\]"),
    ({"instruction": "i"}, "'output' must be a string"),
    ({"instruction": "i", "output": "o", "input": 3}, "'input' must be a string"),
    ({"text": 5}, "'text' must be a string"),
    ({"prompt": "p", "completion": "c"}, "no known fields .found: completion, prompt."),
    ([1, 2], "expected a JSON object, got list"),
])
def test_bad_records_name_file_and_line(tmp_path, record, message):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "ok"}, record])
    with pytest.raises(DataError, match=message) as err:
        read_records(path)
    assert f"{path}:2:" in str(err.value)


# --- batch plan ---------------------------------------------------------------------------------

def test_batch_plan_default_micro_batch_and_accumulation():
    plan = BatchSplit.of(8, None, 2)
    assert (plan.micro_batch_size, plan.accumulation) == (4, 1)
    plan = BatchSplit.of(8, 2, 2)
    assert (plan.micro_batch_size, plan.accumulation) == (2, 2)
    plan = BatchSplit.of(12, 1, 3)
    assert plan.accumulation == 4
    assert plan.micro_batch_size * plan.world_size * plan.accumulation == plan.batch_size


def test_batch_plan_rejects_batch_not_divisible_by_ranks():
    with pytest.raises(BatchError, match=r"--batch-size 8 .* multiple of the 3 ranks"):
        BatchSplit.of(8, None, 3)


@pytest.mark.parametrize("batch, micro, ranks", [(8, 3, 2), (8, 8, 2), (12, 5, 2)])
def test_batch_plan_rejects_micro_batch_that_does_not_divide(batch, micro, ranks):
    with pytest.raises(BatchError, match=rf"micro-batches of {micro} on {ranks} ranks") as err:
        BatchSplit.of(batch, micro, ranks)
    # The suggested micro-batch size really works.
    suggested = int(str(err.value).rsplit("--micro-batch-size ", 1)[1].rstrip(")"))
    BatchSplit.of(batch, suggested, ranks)


# --- sampler ------------------------------------------------------------------------------------

def test_sampler_is_deterministic_per_seed():
    plan = BatchSplit.of(4, 2, 2)
    a, b, c = Sampler(10, plan, 0), Sampler(10, plan, 0), Sampler(10, plan, 1)
    steps = range(12)
    assert [a.global_batch(s) for s in steps] == [b.global_batch(s) for s in steps]
    assert [a.global_batch(s) for s in steps] != [c.global_batch(s) for s in steps]
    # Out-of-order access (as after a resume) gives the same batches.
    assert [b.global_batch(s) for s in reversed(steps)] == [a.global_batch(s) for s in reversed(steps)]
    assert Sampler(10, plan, 0).global_batch(7) == a.global_batch(7)


@pytest.mark.parametrize("n, batch", [(10, 4), (12, 4), (7, 3), (3, 8)])
def test_each_epoch_is_a_permutation(n, batch):
    sampler = Sampler(n, BatchSplit.of(batch, 1, 1), seed=3)
    stream = [i for step in range(5 * n) for i in sampler.global_batch(step)]
    epochs = [stream[e * n:(e + 1) * n] for e in range(len(stream) // n)]
    assert len(epochs) >= 4
    for epoch in epochs:
        assert sorted(epoch) == list(range(n))
    assert len({tuple(e) for e in epochs}) > 1  # reshuffled between epochs


@pytest.mark.parametrize("batch, micro, ranks", [(8, None, 2), (8, 2, 2), (12, 1, 3), (6, 3, 1)])
def test_micro_batches_over_ranks_partition_the_global_batch(batch, micro, ranks):
    plan = BatchSplit.of(batch, micro, ranks)
    sampler = Sampler(20, plan, seed=5)
    for step in range(7):
        pieces = [sampler.micro_batches(step, r) for r in range(ranks)]
        for per_rank in pieces:
            assert len(per_rank) == plan.accumulation
            assert all(len(mb) == plan.micro_batch_size for mb in per_rank)
        flat = [i for per_rank in pieces for mb in per_rank for i in mb]
        assert flat == sampler.global_batch(step)


def test_validation_items_are_seen_once_and_every_rank_runs_as_many_forwards():
    examples = [Example([1] * (i + 2), [1] * (i + 2)) for i in range(10)]
    batcher = Batcher(Layout(examples, 1, 64, 0, torch.device("cpu"), "sdpa", torch.float32))
    per_rank = [list(batcher.lockstep(10, 1, r, 3)) for r in range(3)]
    assert sorted(i for fwds in per_rank for f in fwds for i in f.items) == list(range(10))
    assert {len(fwds) for fwds in per_rank} == {4}  # 4, 3 and 3 items: 4 forwards each, ranks 1, 2 one empty
    assert per_rank[1][-1].items == [] and (per_rank[1][-1].targets == IGNORE).all()
    alone = list(batcher.lockstep(10, 2, 1, 3, together=False))  # a whole model per rank: no empty forward
    assert [len(f.items) for f in alone] == [2, 1]


# --- collate ------------------------------------------------------------------------------------

def test_collate_pads_right_with_ignored_labels_and_zero_mask():
    a = Example([1, 2, 3, 4], [IGNORE, IGNORE, 3, 4])
    b = Example([5, 6], [5, 6])
    batch = collate([a, b], pad_id=99, device=torch.device("cpu"))
    assert batch["input_ids"].tolist() == [[1, 2, 3, 4], [5, 6, 99, 99]]
    assert batch["labels"].tolist() == [[IGNORE, IGNORE, 3, 4], [5, 6, IGNORE, IGNORE]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    assert all(t.dtype == torch.long for t in batch.values())
