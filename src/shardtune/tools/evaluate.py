"""How good a model (optionally with a LoRA adapter) is on a data file: `shardtune eval`.

Two measures:
  loss / perplexity  mean cross-entropy over every target token of the file, the training loss
                     rule (train.loss.next_token_loss_sum summed over records, divided by the target count);
                     perplexity = exp(loss).
  answer accuracy    for records with an expected answer (instruction records' output, chat
                     records' last assistant turn), the greedy answer is compared after
                     normalising both (strip, casefold, collapse whitespace, drop trailing
                     punctuation): exact_match when equal, contains_match when the expected text
                     occurs in the answer as whole words ("paris" in "it is paris." but "4" not in "14").

On N processes evaluation is data-parallel: every rank loads the full model with
``from_pretrained`` (+ the adapter) on its own device, takes every N-th record, and rank 0 adds up
the loss sums and gathers the answers. Simple and exact; it needs one model copy per device,
which is what generation needs anyway. Run by the launcher as ``python -m shardtune.tools.evaluate SPEC.json``.

``--context-parallel C`` cuts the loss's sequences as fine-tuning does (parallel/mesh.py's CP groups of C
consecutive ranks, train/data/batch.py's pieces, Ulysses attention): the ranks of a group take the same
records (every N/C-th), each scores its piece of every row, and the pieces' sums add up to the one-process
loss. Only the activations shrink (each rank still holds the whole model); answers are generated whole,
every N-th question a rank.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from shardtune.config import DataConfig

if TYPE_CHECKING:
    from shardtune.parallel.mesh import ContextGroup

_DEFAULT_SEQ_LEN = DataConfig().seq_len
_TRAILING_PUNCT = ".,;:!?。"


@dataclass
class EvalSpec:
    """Everything a rank needs; written as JSON for worker processes."""

    model: str
    data: str
    adapter: str | None = None
    seq_len: int = _DEFAULT_SEQ_LEN
    batch_size: int = 8
    max_new_tokens: int = 64  # 0: loss only, no generation
    dtype: str = "auto"
    quantize: str = "none"  # "nf4": the 4-bit base a QLoRA adapter was trained on
    answers: bool = False  # include every record's answer in the result
    data_fields: str = ""  # --data-fields: column mapping onto the record fields
    trust_remote_code: bool = False
    context_parallel: int = 1  # ranks each sequence of the loss is cut over
    result: str | None = None  # where rank 0 writes the result (worker processes only)


def normalize(text: str) -> str:
    text = " ".join(text.casefold().split())
    return text.rstrip(_TRAILING_PUNCT + " ").strip()


def exact_match(answer: str, expected: str) -> bool:
    return normalize(answer) == normalize(expected)


def contains_match(answer: str, expected: str) -> bool:
    """The normalised expected text occurs in the normalised answer, not inside a longer word."""
    want = normalize(expected)
    if not want:
        return not normalize(answer)
    return re.search(rf"(?<!\w){re.escape(want)}(?!\w)", normalize(answer)) is not None


@dataclass
class _Work:
    """What every rank reads from the data file, identically."""

    examples: list  # data.Example, for the loss
    questions: list[tuple[list[dict], str]]  # (prompt messages, expected answer)
    records: int
    truncated: int
    without_targets: int


def _read(spec: EvalSpec, tokenizer) -> _Work:
    from shardtune.tools.generate import split_record
    from shardtune.train.data.read import read_records
    from shardtune.train.data.sft import SFT
    from shardtune.train.data.tokenize import load_dataset

    data = load_dataset(spec.data, tokenizer, spec.seq_len, fields=spec.data_fields)
    records = read_records(spec.data, spec.data_fields, SFT.check)
    questions = [(p, e) for p, e in (split_record(r) for _, r in records) if e is not None]
    return _Work(data.examples, questions, len(records), data.truncated, data.without_targets)


@torch.no_grad()
def _evaluate_share(model, tokenizer, spec: EvalSpec, work: _Work, rank: int, world_size: int,
                    context: ContextGroup | None = None) -> dict:
    """This rank's loss sum, target count and answers (by question index). ``context``: its CP group."""
    from shardtune.runtime.progress import progress
    from shardtune.tools.generate import generate_answers

    group, groups = (context.data_rank, context.data_ranks) if context is not None else (rank, world_size)
    mine = len(range(group, len(work.examples), groups))  # every groups-th record
    with progress("eval loss", mine, unit="record", enabled=rank == 0) as bar:
        loss_sum, targets = _loss_share(model, tokenizer, spec, work, rank, world_size, bar.advance, context)
    asked = list(range(rank, len(work.questions), world_size)) if spec.max_new_tokens else []
    answers = []
    if asked:
        with progress("eval answers", len(asked), unit="answer", enabled=rank == 0) as bar:
            answers = generate_answers(model, tokenizer, [work.questions[i][0] for i in asked],
                                       spec.max_new_tokens, batch_size=spec.batch_size, on_batch=bar.advance)
    return {"loss_sum": loss_sum, "targets": targets, "answers": dict(zip(asked, answers))}


def _loss_share(model, tokenizer, spec: EvalSpec, work: _Work, rank: int, world_size: int, on_forward,
                context: ContextGroup | None = None) -> tuple[float, int]:
    """This rank's summed token losses and target count (of its every world_size-th record), by the
    training's loss rule: the loss head (no full logits), attention without a square mask. Every rank
    holds the whole model here: no rank waits for another's forward, but the ranks of a CP group
    (``context``) meet in every attention; they share their data-parallel group's records, each scoring
    its piece, and the group's first rank counts their targets."""
    from shardtune.model import attention
    from shardtune.runtime.distributed import Worker
    from shardtune.train import loss_head
    from shardtune.train.data.batch import Batcher, Layout, pad_id
    from shardtune.train.objectives.sft import Sft
    from shardtune.train.step import Trainee, evaluation_sums

    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    loss_head.install(model)
    with attention.shardtune_attention(model) as impl:
        batcher = Batcher(Layout(work.examples, 1, spec.seq_len, pad_id(tokenizer), device, impl, dtype, context))
        trainee = Trainee(model, None, Sft(), None, Worker(rank, world_size, rank, device))
        sums, norms = evaluation_sums(trainee, batcher, len(work.examples), spec.batch_size, together=False,
                                      on_forward=on_forward)
    group, groups = batcher.data_rank(rank, world_size)
    counts = context is None or context.rank == 0
    mine = sum(work.examples[i].targets for i in range(group, len(work.examples), groups)) if counts else 0
    return sums[0].item() * norms["targets"], mine


def _combine(spec: EvalSpec, work: _Work, shares: list[dict], world_size: int, seconds: float) -> dict[str, Any]:
    from shardtune.tools.generate import prompt_text

    targets = sum(s["targets"] for s in shares)
    loss = sum(s["loss_sum"] for s in shares) / targets
    result: dict[str, Any] = {
        "loss": loss, "perplexity": math.exp(loss) if loss < 700 else None, "records": work.records,
        "target_tokens": targets, "truncated_records": work.truncated, "records_without_targets": work.without_targets,
        "questions": len(work.questions), "exact_match": None, "contains_match": None,
        "model": spec.model, "adapter": spec.adapter, "quantize": spec.quantize, "data": spec.data,
        "world_size": world_size, "context_parallel": spec.context_parallel,
        "seconds": round(seconds, 3),
    }
    answers = {i: a for s in shares for i, a in s["answers"].items()}
    if work.questions and spec.max_new_tokens:
        rows = []
        for i, (prompt, expected) in enumerate(work.questions):
            answer = answers[i]
            rows.append({"question": prompt_text(prompt), "expected": expected, "answer": answer,
                         "exact": exact_match(answer, expected), "contains": contains_match(answer, expected)})
        result["exact_match"] = sum(r["exact"] for r in rows) / len(rows)
        result["contains_match"] = sum(r["contains"] for r in rows) / len(rows)
        if spec.answers:
            result["answers"] = rows
    return result


def evaluate(model_dir: str | Path, data: str | Path, adapter: str | Path | None = None, nproc: int = 1,
             seq_len: int = _DEFAULT_SEQ_LEN, batch_size: int = 8, max_new_tokens: int = 64, dtype: str = "auto",
             answers: bool = False, quantize: str = "none", data_fields: str = "",
             trust_remote_code: bool = False, context_parallel: int = 1) -> dict[str, Any]:
    """Loss, perplexity and answer accuracy of ``model_dir`` (+ ``adapter``) on ``data``; see the module doc.

    ``nproc`` > 1 starts that many worker processes (one per GPU on GPU machines); 1 runs here.
    ``max_new_tokens=0`` measures the loss only. ``answers=True`` adds every question's answer.
    ``data_fields``: column mapping as finetune's ``--data-fields`` (``prompt=question,response=answer``).
    ``context_parallel``: ranks each sequence of the loss is cut over (a divisor of ``nproc``; see the module doc).
    """
    from shardtune.config import ConfigError
    from shardtune.model.directory import check_model_dir
    from shardtune.model.meta import build_meta_model, check_positions
    from shardtune.tools.generate import check_adapter_dir, resolve_quantize

    for name, value in (("nproc", nproc), ("seq-len", seq_len), ("batch-size", batch_size),
                        ("context-parallel", context_parallel)):
        if value < 1:
            raise ConfigError(f"option '{name}' must be at least 1, got {value}")
    if max_new_tokens < 0:
        raise ConfigError(f"option 'max-new-tokens' must be at least 0, got {max_new_tokens}")
    base = check_model_dir(model_dir, trust_remote_code)
    meta = build_meta_model(base, torch.float32)  # from its config: no weight read
    check_positions(meta, seq_len, f"--seq-len {seq_len}", model_dir)
    if context_parallel > 1:
        _check_context_parallel(meta, context_parallel, nproc)
    # before any worker starts: the adapter whole, and made from this base (the workers do not check again)
    check_adapter_dir(adapter, base if adapter is not None else None)
    spec = EvalSpec(str(model_dir), str(data), str(adapter) if adapter is not None else None, seq_len, batch_size,
                    max_new_tokens, dtype, resolve_quantize(quantize, adapter), answers, data_fields, trust_remote_code,
                    context_parallel)
    if nproc == 1:
        return _run_here(spec)
    return _run_workers(spec, nproc)


def _check_context_parallel(meta: torch.nn.Module, size: int, nproc: int) -> None:
    """Fine-tuning's refusals of ``--context-parallel size``, before any weight is read: the ranks must form
    CP groups of ``size``, and the model's attention (of ``meta``, built from its config alone) must be one the
    pieces can meet in."""
    from shardtune.config import ConfigError, context_ranks_refusal
    from shardtune.model.attention import check_context_parallel

    refused = context_ranks_refusal(size, nproc, flags="--nproc")
    if refused:
        raise ConfigError(refused)
    check_context_parallel(meta, size)


def _run_here(spec: EvalSpec) -> dict[str, Any]:
    from shardtune.runtime.logs import quiet_libraries
    from shardtune.tools.generate import load_model

    quiet_libraries()  # as shardtune.finetune does in the calling process
    started = time.perf_counter()
    from shardtune.runtime.progress import progress

    with progress("loading model", 1, unit="model", delay=1) as bar:  # no bar for a load that fails at once
        model, tokenizer = load_model(spec.model, spec.adapter, spec.dtype, quantize=spec.quantize,
                                      trust_remote_code=spec.trust_remote_code)
        bar.advance()
    work = _read(spec, tokenizer)
    share = _evaluate_share(model, tokenizer, spec, work, 0, 1)
    return _combine(spec, work, [share], 1, time.perf_counter() - started)


def _run_workers(spec: EvalSpec, nproc: int) -> dict[str, Any]:

    from shardtune.config import ParallelConfig
    from shardtune.model.directory import check_model_dir, load_tokenizer
    from shardtune.runtime.worker_failures import WorkerError
    from shardtune.runtime.workers import launch_workers

    # Bad paths or data fail here in a second, not in N workers after they have loaded the model.
    tokenizer = load_tokenizer(check_model_dir(spec.model, spec.trust_remote_code))
    _read(spec, tokenizer)
    with tempfile.TemporaryDirectory(prefix="shardtune-eval-") as tmp:
        spec_path, result_path = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        spec_path.write_text(json.dumps(dataclasses.asdict(spec) | {"result": str(result_path)}))
        launch_workers(ParallelConfig(nproc=nproc), "shardtune.tools.evaluate", [str(spec_path)])
        if not result_path.is_file():
            raise WorkerError(f"the eval workers finished but wrote no {result_path}")
        return json.loads(result_path.read_text())


def worker(spec: EvalSpec) -> None:
    """One rank of a multi-process evaluation; rank 0 writes the result to ``spec.result``."""
    from shardtune.parallel.mesh import context_group
    from shardtune.runtime import distributed
    from shardtune.runtime.logs import setup_logging
    from shardtune.runtime.progress import progress
    from shardtune.tools.generate import load_model
    from shardtune.train.metrics import write_json_atomic

    started = time.perf_counter()
    worker = distributed.init_worker()
    setup_logging(worker.rank)
    try:
        context = context_group(worker, spec.context_parallel) if spec.context_parallel > 1 else None
        with progress("loading model", 1, unit="model", enabled=worker.is_main, delay=1) as bar:
            model, tokenizer = load_model(spec.model, spec.adapter, spec.dtype, worker.device, spec.quantize,
                                          spec.trust_remote_code, check_base=False)
            bar.advance()
        work = _read(spec, tokenizer)
        share = _evaluate_share(model, tokenizer, spec, work, worker.rank, worker.world_size, context)
        shares = distributed.all_gather_object(share)
        if worker.is_main:
            result = _combine(spec, work, shares, worker.world_size, time.perf_counter() - started)
            write_json_atomic(Path(spec.result), result)
    finally:
        distributed.teardown()


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        sys.exit("usage: python -m shardtune.tools.evaluate SPEC.json  "
                 "(normally started by `shardtune eval --nproc N`)")
    worker(EvalSpec(**json.loads(Path(argv[0]).read_text())))


if __name__ == "__main__":
    from shardtune.runtime import distributed

    distributed.worker_main(main)
