"""The planner's memory model: each rank's peak per strategy, predicted before any weight is read.

The model's sizes and saved activations come from footprint.py (config.json, a meta model, the
safetensors headers). A rank's memory is what it keeps for the whole run (runtime, weights, LoRA
state) plus what the busiest moment of a training step adds; the moments are listed per strategy in
``_moments`` and the prediction names the one that wins. The constants below were fitted to measured
peaks (bench/memory.py); ``shardtune plan`` (memory_table.py) renders the predictions.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from shardtune.config import traits
from shardtune.model.footprint import Facts, Saved
from shardtune.model.nf4_torchao import DEQUANT_CHUNK
from shardtune.parallel.sharded_embeddings import lookup_buffers, lookup_cost, planned_piece
from shardtune.runtime import cpu_tuning
from shardtune.runtime.budget import memory_per_rank
from shardtune.runtime.memory import MB
from shardtune.train.loss import CHUNK_BYTES
from shardtune.train.loss_head import chunk_tokens as loss_head_chunk
from shardtune.train.target_logprobs import scoring_cost

if TYPE_CHECKING:
    from shardtune.config import Config
    from shardtune.train.data.records import Lengths

#: A worker's private memory before loading (CPU): torch, transformers, peft, gloo, tokenizer, data
#: (the recipe imports peft before it starts loading, so this is all code, no model).
RUNTIME_CPU_MB = 295
#: What a CPU worker adds once it loads and trains, whatever the model: the model's and optimizer's
#: Python objects, autograd's and the memory sampler's threads, glibc's per-thread arenas. The limit of
#: the measured peak minus RUNTIME_CPU_MB as the model shrinks to nothing (tests/test_equivalence.py).
#: Workers forked from the warm starter (runtime/warm_start.py) have imported before loading what a fresh
#: one imports while it trains: about 1 MB less here than for a fresh worker.
STEP_OVERHEAD_CPU_MB = 7
#: What a sharded strategy (FSDP1, FSDP2) adds to that on a CPU worker, whatever the model: FSDP's state
#: per unit, its hooks and DTensor metadata, gloo's work objects. Fitted to tests/test_equivalence.py's
#: runs with warm-started workers (fsdp1, and fsdp2 with part and layer units; nothing for ddp); fresh
#: workers, which import DTensor's and FSDP's modules while they train, add 1–3 MB more.
SHARDED_OVERHEAD_CPU_MB = 6
#: transformers before 5.2x imports scikit-learn (and with it pandas) whenever it is installed, from
#: ``generation/candidate_generator.py``: that much more in every worker (bench/memory.py measures it).
EAGER_SKLEARN_MB = 51


def runtime_cpu_mb() -> float:
    """A CPU worker's private memory before loading, on the transformers release installed here."""
    from transformers.generation import candidate_generator

    return RUNTIME_CPU_MB + (EAGER_SKLEARN_MB if hasattr(candidate_generator, "roc_curve") else 0)


#: On GPU: the CUDA context, which ``max_memory_allocated`` does not count but the GPU must hold.
CUDA_CONTEXT_MB = 500
#: On GPU, per NCCL communicator a rank uses (none with one rank): NCCL's own buffers, outside torch's
#: allocator. They grow with NCCL's channels (NVLink machines use many, PCIe few) and its algorithms;
#: NCCL's maintainers put one communicator at 1-2 GB on NVLink (NVIDIA/nccl#864). An upper estimate
#: for NVLink nodes, not a measurement: bench/gpu_check.sh measures what a run holds outside torch.
NCCL_COMM_MB = 1024
#: Copies of a unit held while it is all-gathered. FSDP2 gathers into a buffer, then copies out
#: (shardtune's gloo all-gather adds nothing); FSDP1 gathers into the unsharded flat parameter, but
#: gloo's all-gather receives into a buffer of its own first. Measured on CPU (bench/memory.py); the
#: CUDA values follow from the code (NCCL gathers in place), not from a measurement. On CPU with
#: shared gather buffers (parallel/host_gather.py) FSDP2's buffers are the "buffers" term instead.
GATHER_COPIES = {("fsdp2", "cpu"): 2, ("fsdp1", "cpu"): 2, ("fsdp2", "cuda"): 2, ("fsdp1", "cuda"): 1}
#: Shared gather buffers per unit size (host_gather.py: one being read while the next is written).
SHARED_BUFFERS = 2
#: FSDP1's decoder blocks unsharded at once in backward: the one computing and the one prefetched
#: while gathered (CPU: measured; CUDA: from the code). FSDP2's units: ``_fsdp2_moments``.
BACKWARD_BLOCKS = {("fsdp1", "cpu"): 3, ("fsdp1", "cuda"): 2}

TERMS: dict[str, str] = {
    "runtime": "the process before loading (torch, transformers, peft, process group, data) and what "
               f"training adds whatever the model (on GPU: the CUDA context, {CUDA_CONTEXT_MB} MB, and NCCL's "
               f"buffers, {NCCL_COMM_MB} MB per communicator: one on several ranks, three under HSDP)",
    "weights": "the frozen base weights this rank holds: 1/N of them under FSDP, all of them under DDP/single "
               "(GRPO's generation kept gathered under FSDP2: only what it does not hold gathered)",
    "blocks": "decoder-layer weights all-gathered (unsharded) at once, in the compute dtype: FSDP1 whole "
              "layers; FSDP2 the unit computing plus the next one gathered (a layer's attention, MLP "
              "projections and norms are units of their own)",
    "buffers": "CPU, FSDP2: the buffers decoder-layer units are gathered into, shared by the ranks of a "
               "host and kept for the whole run, two per unit size (each rank maps them in full)",
    "root": "non-layer weights unsharded: FSDP2 uses frozen embeddings from row shards (one rank's rows "
            "in a buffer at a time, or, with few tokens, none: the tokens are exchanged instead, in pieces) "
            "and gathers others; FSDP1 keeps its root unit (embeddings, final norm, lm_head) unsharded from "
            "forward to the end of backward",
    "lora": "the trainable LoRA weights, fp32 (1/N of them under FSDP)",
    "grads": "their fp32 gradients (1/N under FSDP; DDP also keeps a bucket copy for its all-reduce)",
    "optimizer": "AdamW state: 2 fp32 values per trainable weight (1/N under FSDP)",
    "activations": "tensors saved for backward, all layers, and what the backward of one layer adds to its "
                   "saved set (with activation checkpointing: each layer's input, and the most one layer's "
                   "recomputation and backward hold at once; both traced on fake tensors)",
    "logits": "the loss head: one chunk of tokens' logits in fp32 at a time, and what it keeps per token for "
              "backward (tokens × hidden); scoring FSDP2's row-sharded head by exchange, every rank's tokens "
              "of a piece; without it (a trained head) the full logits and their gradient",
    "kv_cache": "GRPO's generation: the KV cache of the completions a rank samples at once (keys and values "
                "of every layer for prompt + completion tokens), with the last position's logits",
    "dequant": "--quantize nf4: the largest 4-bit weight dequantized to the compute dtype for its matmul, with "
               "its codes and values a chunk at a time (forward, backward, and each token of GRPO's generation); "
               "while loading, a rank's bf16 slice of it being quantized; in GRPO's generation, when they fit, "
               "every 4-bit weight dequantized once for the whole generation; under activation checkpointing, when "
               "they fit, a layer's 4-bit weights dequantized by its recompute and kept for its backward",
}
#: Bytes per weight while a bf16 slice is quantized (the slice, its scaled copy, one code byte per
#: weight, the packed codes), as a multiple of the slice's bf16 bytes: torchao's to_nf4 steps.
QUANTIZE_SLICE_COPIES = 2.75


@dataclass
class Prediction:
    strategy: str
    ranks: int
    activation_checkpointing: bool
    cpu_offload: bool
    terms: dict[str, float]  # MB on the device (GPU memory, or the process's private RAM on CPU)
    moment: str  # when in the step the peak happens
    host_mb: float = 0.0  # what CPU offload keeps in host RAM instead
    read_mb: float = 0.0  # checkpoint bytes each rank reads while loading
    block_mb: float = 0.0  # the largest decoder layer, unsharded
    quantize_slice_mb: float = 0.0  # --quantize nf4: the largest weight's bf16 slice a rank quantizes at load
    fits: bool | None = None
    note: str = ""
    runs: bool = False  # the row `finetune` would run (choice.strategy_rows marks it)

    @property
    def peak_mb(self) -> float:
        return sum(self.terms.values())

    def as_dict(self) -> dict:
        return {"peak_mb": round(self.peak_mb, 3), "fits": self.fits, "ranks": self.ranks,
                "activation_checkpointing": self.activation_checkpointing, "cpu_offload": self.cpu_offload,
                "peak_at": self.moment, "terms": {k: round(v, 3) for k, v in self.terms.items()},
                "host_mb": round(self.host_mb, 3), "read_mb": round(self.read_mb, 3),
                "block_mb": round(self.block_mb, 3), "quantize_slice_mb": round(self.quantize_slice_mb, 3),
                "note": self.note, "runs": self.runs}


def _moments(strategy: str, device: str, f: Facts, n: int, acts: float, workspace: float, logits_fwd: float,
             logits_bwd: float, unit: str = "part",
             pieces: dict[str, int] | None = None) -> dict[str, dict[str, float]]:
    """The busiest moments of a step for ``strategy``: {moment: the terms it adds to the kept state}.
    ``pieces``: FSDP2's row-sharded tables used by exchange (``_exchange_pieces``)."""
    copies = GATHER_COPIES.get((strategy, device), 0)
    t = traits(strategy)
    if t.fsdp_unit:
        units = f.units_bytes if unit == "part" else [f.block_bytes]
        # whole-layer units keep the last layer gathered from its forward into its backward
        last_kept = f.block_bytes if unit == "layer" else 0.0
        buffers = 0.0
        if device == "cpu" and n > 1 and cpu_tuning.shared_gather_enabled():
            copies, buffers = 1, SHARED_BUFFERS * sum(set(units))
        moments = _fsdp2_moments(device, f, n, copies, acts, workspace, logits_fwd, logits_bwd, units, last_kept,
                                 pieces or {})
        for terms in moments.values():
            terms["buffers"] = buffers
        return moments
    blocks = BACKWARD_BLOCKS.get((strategy, device), 0) * f.block_bytes
    if t.table_units and f.head_bytes:  # untied tables are units of their own (parallel/fsdp1.py)
        # The gather's extra copies last only while it runs, before the logits exist.
        return {
            "start of forward (input embedding gathered)": {"root": copies * f.embed_bytes},
            "output embedding gathered": {"root": copies * f.head_bytes, "activations": acts},
            "end of forward": {"root": f.head_bytes, "activations": acts, "logits": logits_fwd},
            "start of backward (logits)": {"root": f.head_bytes, "activations": acts, "logits": logits_bwd},
            "backward through the layers": {"blocks": blocks, "activations": acts + workspace},
        }
    # The whole root unsharded for the step: FSDP1's root (tied embeddings, final norm).
    root = f.root_bytes if copies else 0
    moments = {
        "end of forward": {"root": root, "activations": acts, "logits": logits_fwd},
        "start of backward (logits)": {"root": root, "activations": acts, "logits": logits_bwd},
        "backward through the layers": {"root": root, "blocks": blocks, "activations": acts + workspace},
    }
    if copies > 1:  # before any activation exists
        moments["start of forward (root gathered)"] = {"root": copies * root}
    return moments


def _fsdp2_moments(device: str, f: Facts, n: int, copies: int, acts: float, workspace: float,
                   logits_fwd: float, logits_bwd: float, units: list[int], last_kept: float = 0.0,
                   pieces: dict[str, int] | None = None) -> dict[str, dict[str, float]]:
    """FSDP2 as parallel/fsdp2.py applies it: ``units`` per decoder layer (whole layers, or their
    parts); frozen embeddings used from row shards (one rank's rows in a buffer at a time, or, where
    ``pieces`` says so, the tokens exchanged a piece at a time), others gathered in units."""
    pieces = pieces or {}
    # The unit computing while the next one is gathered into a buffer and copied out (CPU, measured);
    # on CUDA FSDP2 also keeps one more gathered unit for stream overlap (from the code).
    window = 2 if device == "cpu" else 3
    gathered = max((sum(units[i:i + window - 1]) + copies * units[i + window - 1]
                    for i in range(len(units) - window + 1)), default=copies * sum(units))
    if pieces.get("embed"):  # the tokens exchanged a piece at a time
        embed = float(lookup_buffers(n, pieces["embed"], f.hidden, f.compute_itemsize))
    elif f.tables_by_rows["embed"]:
        embed = f.embed_bytes / n
    else:  # gathered: in a unit of its own when untied, else in the root with the tied head
        embed = copies * (f.embed_bytes if f.head_bytes else f.root_bytes)
    if pieces.get("head"):  # no rows moved: the exchange's buffers are the loss head's (``_head_terms``)
        head_fwd = head_bwd = 0.0
    elif f.tables_by_rows["head"]:
        head_fwd = head_bwd = (f.head_bytes or f.embed_bytes) / n  # each rank's rows written in place
    elif f.head_bytes:  # its own unit, kept from the end of forward into backward
        head_fwd, head_bwd = copies * f.head_bytes, f.head_bytes
    else:
        head_fwd = head_bwd = f.root_bytes
    root_kept = 0.0 if f.tables_by_rows["embed"] or f.head_bytes else f.root_bytes
    return {
        "start of forward (input embedding)": {"root": embed},
        "end of forward (output embedding)": {"root": head_fwd, "blocks": last_kept, "activations": acts,
                                              "logits": logits_fwd},
        "start of backward (logits)": {"root": head_bwd, "blocks": last_kept, "activations": acts,
                                       "logits": logits_bwd},
        "backward through the layers": {"root": root_kept, "blocks": gathered, "activations": acts + workspace},
    }


def row_sharded_bytes(f: Facts) -> float:
    """The frozen embedding tables FSDP2 uses from row shards (parallel/fsdp2.py), whole: a tied table once."""
    embed = f.embed_bytes if f.tables_by_rows["embed"] else 0
    head = f.head_bytes if f.tables_by_rows["head"] else 0  # 0 when tied: the same table as embed
    return float(embed + head)


def _exchange_pieces(f: Facts, tokens: int, n: int) -> dict[str, int]:
    """FSDP2's row-sharded tables in a training step ({"embed": …, "head": …}): the tokens per rank of one
    exchange where the runtime's rule (``sharded_embeddings.planned_piece``, with the lookup's and the loss
    head's costs) exchanges the ``tokens`` a rank of the widest micro-batch instead of broadcasting the
    table's rows; 0 where it broadcasts them. The full logits, made where the loss head does not score, are
    always made from broadcast rows."""
    width, item = f.hidden, f.compute_itemsize
    pieces = {"embed": 0, "head": 0}
    if f.tables_by_rows["embed"] and f.embed_bytes:
        vocab = f.embed_bytes // (width * item)
        pieces["embed"] = planned_piece(vocab, width, item, n, tokens, lookup_cost(width, item))
    if f.tables_by_rows["head"] and f.chunked_head:
        vocab = (f.head_bytes or f.embed_bytes) // (width * item)
        # with a gradient: the step's forward, whose buffers are the largest
        pieces["head"] = planned_piece(vocab, width, item, n, tokens, scoring_cost(width, item, n, grad=True))
    return pieces


def nccl_communicators(strategy: str, ranks: int, replicate_groups: int = 1) -> int:
    """NCCL communicators a rank of ``strategy`` uses on ``ranks`` GPUs: the world's (FSDP, DDP, the loss's
    all-reduce); HSDP adds its shard and replica groups (parallel/mesh.py)."""
    if traits(strategy).one_process or ranks == 1:
        return 0
    return 3 if replicate_groups > 1 and traits(strategy).hsdp else 1


@dataclass(frozen=True)
class Setting:
    """One way to run a training step, as the memory model sees it."""

    strategy: str
    ranks: int
    rows: int  # sequences one forward computes (a preference pair is two)
    row_tokens: int  # tokens in each (``row_tokens``)
    activation_checkpointing: bool = False
    cpu_offload: bool = False
    #: HSDP (> 1) shards over the ranks of one group only: a rank holds 1/(ranks/groups)
    replicate_groups: int = 1
    fsdp_unit: str = "part"  # FSDP2's unit of sharding, "layer" or "part" (others: ignored)
    mlp_tile: int = 0  # tokens per MLP tile (--mlp-tile); 0: untiled
    loss_chunk: int = 0  # tokens per loss-head chunk (--loss-chunk); 0: its default
    activation_offload: bool = False  # --activation-offload: saved activations in pinned host memory (GPUs)
    context_parallel: int = 1  # ranks a sequence is cut over (--context-parallel): each holds a piece
    #: GRPO: completions a rank samples at once, and their prompt + completion tokens (0: no generation)
    generation_rows: int = 0
    generation_tokens: int = 0
    #: GRPO under FSDP2: the whole model stays gathered for the generation (``RunPlan.generation_gathered``)
    generation_gathered: bool = False
    #: kept gathered, every NF4 weight dequantized once for the generation (``RunPlan.generation_dequantized``)
    generation_dequantized: bool = False
    #: GRPO under FSDP2: no layer gathered, each projection exchanged (``RunPlan.generation_exchanged``)
    generation_exchanged: bool = False
    #: exchanged, every rank of a shard group samples all of its rows (``RunPlan.generation_replicated``)
    generation_replicated: bool = False
    #: kept gathered, into the training step that follows too (``RunPlan.generation_carried``)
    generation_carried: bool = False
    #: GRPO under FSDP2, training too: the frozen projections outside FSDP, exchanged (``RunPlan.layers_exchanged``)
    layers_exchanged: bool = False
    #: --quantize nf4 under activation checkpointing: a layer's recompute keeps its NF4 weights' values for its
    #: backward (``RunPlan.recompute_dequantized``)
    recompute_dequantized: bool = False


def predict(f: Facts, s: Setting, device: str) -> Prediction:
    """The per-rank peak of setting ``s`` on ``device`` ('cuda' or 'cpu'), in MB, from the model's facts."""
    strategy, ranks, micro_batch, seq_len = s.strategy, s.ranks, s.rows, s.row_tokens
    ac, offload, unit, replicate_groups = s.activation_checkpointing, s.cpu_offload, s.fsdp_unit, s.replicate_groups
    t = traits(strategy)
    sharded = t.shards
    n = ranks // replicate_groups if sharded else 1
    # LoRA computes in the compute dtype under every strategy (parallel/compute_dtype.py): fp16's too
    saved = f.saved_for(micro_batch, f.dtype, seq_len)
    cp = s.context_parallel
    if cp > 1:  # this rank's piece of every row: what is saved per token shrinks with it
        saved, seq_len = context_parallel_terms(f, saved, micro_batch, seq_len, cp)
    micro_tokens = micro_batch * seq_len
    layer_input = micro_tokens * f.hidden * f.compute_itemsize  # a decoder layer's input (and its MLP's)
    kept_by_layer, recomputed = _layer_sets(saved, s.mlp_tile, seq_len, layer_input)
    offloading = s.activation_offload and device == "cuda"
    host_acts = 0.0
    if ac:
        # Each layer keeps only its input; in backward one layer at a time recomputes its own set.
        inputs = f.layers * layer_input
        if offloading:  # the inputs wait in host memory; two layers' are on the GPU (one in use, one coming)
            host_acts, inputs = inputs, min(f.layers, 2) * layer_input
        acts = inputs + saved.outside
        workspace = _recomputed_backward(saved, recomputed) + layer_input  # + the gradient from above
    else:
        # A layer's saved set exists already (in ``acts``): its backward adds what the traced recompute and
        # backward holds beyond that set (its gradients' temporaries, and a tiled MLP's tile recomputed), and
        # the gradient from above.
        acts = sum(kept_by_layer) + saved.outside
        workspace = max(0.0, _recomputed_backward(saved, recomputed) - max(kept_by_layer, default=0)) + layer_input
        if offloading:
            host_acts, acts = sum(kept_by_layer), 2 * max(kept_by_layer, default=0) + saved.outside
    if cp > 1:
        # One layer's all-to-all buffers exist inside its attention, in the recomputed forward and in
        # backward once the MLP's gradients are done and its saved set freed: they add to the attention's
        # share of the layer's set, not to the MLP's peak.
        attention = max((p - m for p, m in zip(saved.per_layer, saved.mlp)), default=0)
        workspace = max(workspace, attention + layer_input + exchange_bytes(f, micro_batch, seq_len, cp))
    by_rows = t.row_tables and f.tables_by_rows["head"]
    pieces = _exchange_pieces(f, micro_tokens, n) if t.row_tables else {}
    logits_fwd, logits_bwd = _head_terms(f, micro_tokens, saved.vocab, n if by_rows else 1, s.loss_chunk,
                                         pieces.get("head", 0))
    lora = 4 * f.trainable_params / n
    runtime = (CUDA_CONTEXT_MB + NCCL_COMM_MB * nccl_communicators(strategy, ranks, replicate_groups)
               if device == "cuda" else
               runtime_cpu_mb() + STEP_OVERHEAD_CPU_MB + (SHARDED_OVERHEAD_CPU_MB if sharded else 0))
    kept = {
        "runtime": runtime * MB,
        "weights": f.frozen_bytes / n,
        "lora": lora,
        "grads": lora * (2 if t.grad_buckets else 1),
        "optimizer": 2 * lora,
    }
    host = host_acts
    if offload and device == "cuda":  # the shards and their optimizer live in host RAM...
        # ...but for FSDP2's row-sharded embedding tables: outside FSDP, they stay on the GPU; so do the
        # NF4 weights where one rank holds them whole (parallel/fsdp2.py: a shard group of one; fsdp1 has no NF4)
        on_gpu = (row_sharded_bytes(f) / n if t.row_tables else 0.0) + (f.nf4_bytes if n == 1 else 0)
        host += sum(kept[k] for k in ("weights", "lora", "grads", "optimizer")) - on_gpu
        kept.update(weights=on_gpu, lora=0.0, grads=0.0, optimizer=0.0)
    layers = f
    if s.layers_exchanged and n > 1 and t.shards:
        # FSDP2's units gather only what is not a frozen projection (LoRA's weights; norms are small); each
        # projection's exchange buffers exist while it runs, forward or backward
        rest = f.trainable_params * f.compute_itemsize / max(f.layers, 1)
        layers = replace(f, block_bytes=rest, units_bytes=[rest] * max(len(f.units_bytes), 1))
        workspace += exchange_buffers(f, n, micro_tokens)
    moments = _moments(strategy, device, layers, n, acts, workspace, logits_fwd, logits_bwd, unit, pieces)
    if f.dequant_bytes:  # one 4-bit weight dequantized at a time (exchanged: the rank's rows of it)
        exchanged = s.layers_exchanged and n > 1 and t.shards
        moments["backward through the layers"]["dequant"] = backward_dequant(f, s, n if exchanged else 1)
        # loading: the shard so far plus one slice being quantized (no gradients or optimizer yet)
        moments["loading (a weight's slice quantized)"] = {
            "dequant": QUANTIZE_SLICE_COPIES * f.quantize_slice_bytes / n,
            "grads": -kept["grads"], "optimizer": -kept["optimizer"]}
    if s.generation_rows:
        # CPU FSDP2's shared gather buffers are kept for the whole run: generation gathers through them too
        buffers = next(iter(moments.values())).get("buffers", 0.0)
        generation = _generation_terms(f, s, n, saved.vocab, kept, buffers, offload and device == "cuda")
        if s.generation_carried and s.generation_gathered and n > 1 and t.shards:
            # the training step after it starts with every unit gathered and its frozen shards freed, as the
            # generation left them, each let go only by its backward: its every moment with all of them held
            for name, terms in [(k, v) for k, v in moments.items() if not k.startswith("loading")]:
                moments[f"{name}, the generation's weights held"] = {
                    **terms, "blocks": generation["blocks"], "weights": generation["weights"]}
        moments["generation (KV cache)"] = generation
    moment, extra = max(moments.items(), key=lambda kv: sum(kv[1].values()))
    terms = {k: kept.get(k, 0.0) + extra.get(k, 0.0) for k in TERMS}
    note = ""
    if (offload or s.activation_offload) and device != "cuda":
        note = "on CPU, offloading changes nothing: what it would move is in RAM already"
    return Prediction(strategy, n, ac, offload, {k: v / MB for k, v in terms.items()}, moment,
                      host_mb=host / MB, read_mb=f.checkpoint_bytes / n / MB, block_mb=f.block_bytes / MB,
                      quantize_slice_mb=f.quantize_slice_bytes / n / MB,
                      note=note)


def _recomputed_backward(saved: Saved, recomputed: list[float]) -> float:
    """What one checkpointed layer's backward holds at once: the traced peak of recomputing the layer
    that saves the most and running backward through it (``Saved.backward``), in proportion to what is
    recomputed here (a tiled MLP recomputes one tile's set)."""
    heaviest = max(saved.per_layer, default=0)
    return saved.backward / heaviest * max(recomputed) if heaviest else 0.0


def _layer_sets(saved: Saved, tile: int, seq_len: int, layer_input: int) -> tuple[list[float], list[float]]:
    """Per decoder layer: what its forward keeps for backward, and what exists while backward recomputes
    it. Tiled (``tile`` tokens, parallel/tiling.py), an MLP keeps only its input (the tiles' checkpoints)
    and recomputes one tile's set at a time."""
    if not tile or tile >= seq_len:
        return list(saved.per_layer), list(saved.per_layer)
    share = tile / seq_len
    kept = [total - mlp + (layer_input if mlp else 0) for total, mlp in zip(saved.per_layer, saved.mlp)]
    return kept, [k + share * mlp for k, mlp in zip(kept, saved.mlp)]


def context_parallel_terms(f: Facts, saved: Saved, rows: int, seq_len: int, cp: int) -> tuple[Saved, int]:
    """(what is saved, tokens per row) on one rank of a CP group of ``cp``: its piece of each row
    (parallel/context_parallel.py). Everything but attention is saved per token, so 1/cp of the whole
    row's (traced at ``seq_len``); Ulysses attention (parallel/ulysses.py) keeps its share of the heads
    over the whole row, which exceeds 1/cp on the busiest rank when the heads do not divide cp
    (``HeadShares.most_heads``): that excess is added."""
    from shardtune.parallel.ulysses import head_shares

    piece = -(-seq_len // cp)
    scale = piece / seq_len
    extra = 0.0
    if f.heads:
        held = f.heads + 2 * f.kv_heads  # q, k, v; the output is a q-sized share too
        most = head_shares(f.heads, f.kv_heads, cp).most_heads
        extra = max(0.0, most - held / cp) * rows * piece * cp * f.head_dim * f.compute_itemsize
    return replace(saved, per_layer=[b * scale + extra for b in saved.per_layer],
                   mlp=[b * scale for b in saved.mlp], outside=saved.outside * scale,
                   backward=saved.backward * scale + extra), piece


def exchange_bytes(f: Facts, rows: int, piece: int, cp: int) -> float:
    """Ulysses' all-to-all buffers for one layer (parallel/ulysses.py: what is sent, what is received,
    and its rearranged copy), about three times the rank's q, k and v of its piece."""
    return 3 * (f.heads + 2 * f.kv_heads) * rows * piece * f.head_dim * f.compute_itemsize


def exchange_buffers(f: Facts, n: int, tokens: int) -> float:
    """What a projection's exchange holds while it runs (parallel/exchange.py) for ``tokens`` tokens a rank on
    ``n`` ranks: the inputs of every rank, the widest (the MLP's, about four hidden states a token), and the
    outputs sent and received (in backward: the gradients, and the partial sums sent back)."""
    return (n + 2) * tokens * 4 * f.hidden * f.compute_itemsize


def _generation_terms(f: Facts, s: Setting, n: int, vocab: int, kept: dict[str, float],
                      buffers: float, shards_on_host: bool = False) -> dict[str, float]:
    """GRPO's generation, before the step's backward (no gradients yet): the KV cache of the rank's rows,
    the weights a forward gathers (a layer at a time under FSDP; kept gathered, the whole model in the
    compute dtype, plus one unit's gather buffer, or the shared ``buffers`` kept for the run on CPU, while
    the frozen shards it holds are freed (compat.fsdp2_frozen_shards_released: not NF4's, not those
    ``shards_on_host`` under --cpu-offload on a GPU); row-sharded tables are never gathered:
    sharded_embeddings.exchanged), one
    layer's prefill activations (no_grad) and the last position's logits with the sampler's fp64 softmax
    and cumulative sum; a 4-bit base's weights dequantized for each matmul, one at a time (``dequantizing``), or
    once (``generation_dequantized``), every NF4 weight in the compute dtype (the rank's rows of each when
    exchanged). Exchanged (``generation_exchanged``), no layer is gathered;
    replicated too (``generation_replicated``), every rank of the shard group holds the KV cache, activations
    and logits of all the group's rows, and a projection's outputs of them all (its rows', the gathered, the cut).
    The vocabulary-parallel head's exchange (the rank's block of every rank's logits, then its own logits
    received) is two logits' worth, inside the forward, before the sampler's temporaries exist: within the
    logits term."""
    rows, tokens = s.generation_rows, s.generation_tokens
    shards = n // max(s.replicate_groups, 1)
    replicated = s.generation_replicated and s.generation_exchanged and shards > 1 and traits(s.strategy).shards
    if replicated:
        rows *= shards
    # through CPU FSDP2's shared ``buffers`` a gathered unit is one copy; else FSDP2's buffer and copy-out
    copies = 1 if buffers else GATHER_COPIES.get((s.strategy, "cuda"), 0)
    gathered = copies * f.block_bytes if n > 1 else 0.0
    by_rows = row_sharded_bytes(f) if traits(s.strategy).row_tables else 0  # never gathered, never freed
    root = f.root_bytes - by_rows
    exchange = freed = 0.0
    if s.generation_exchanged and n > 1 and traits(s.strategy).shards:
        # no layer gathered: what is not a frozen projection (LoRA's weights, norms, a table not used by
        # rows) is gathered once; each projection's inputs from every rank, the widest (the MLP's, about
        # four hidden states a token) at the prefill, with its outputs sent and received
        gathered = root + f.trainable_params * f.compute_itemsize
        # replicated: every rank holds every rank's inputs already; its rows' outputs, all of them gathered and
        # each projection's cut from those
        exchange = 3 * rows * tokens * 4 * f.hidden * f.compute_itemsize if replicated else \
            exchange_buffers(f, n, rows * tokens)
    elif s.generation_gathered and n > 1 and traits(s.strategy).shards:
        gathered = f.layers * f.block_bytes + root + max(0, copies - 1) * f.block_bytes
        if not shards_on_host:
            freed = (f.frozen_bytes - f.nf4_bytes - by_rows) / n
    prefill = 8 * rows * tokens * f.hidden * f.compute_itemsize
    rows_of = n if s.generation_exchanged else 1  # exchanged: each rank dequantizes its rows of a weight
    if not f.dequant_bytes:
        dequant = 0.0
    elif s.generation_dequantized:  # every weight's values kept, the last one's temporaries beside them
        dequant = f.nf4_dequantized_bytes / rows_of + dequantizing(f, rows_of) - f.dequant_bytes / rows_of
    else:  # each matmul of each token dequantizes its weight, one at a time
        dequant = dequantizing(f, rows_of)
    return {"kv_cache": rows * tokens * f.kv_bytes_per_token + rows * vocab * (f.compute_itemsize + 4 + 16),
            "blocks": gathered, "buffers": buffers, "activations": prefill + exchange, "grads": -kept["grads"],
            "dequant": dequant, "weights": -freed}


def backward_dequant(f: Facts, s: Setting, rows_of: int = 1) -> float:
    """What a 4-bit base's dequantization holds as backward goes through a layer: one weight dequantized at a time
    (``dequantizing``), or, where the recompute keeps the values (``recompute_dequantized``), the layer's, the last
    one's temporaries beside them (its backward then dequantizes none)."""
    if s.recompute_dequantized and s.activation_checkpointing:
        return (f.nf4_layer_dequantized_bytes - f.dequant_bytes) / rows_of + dequantizing(f, rows_of)
    return dequantizing(f, rows_of)


def dequantizing(f: Facts, rows_of: int = 1) -> float:
    """What dequantizing the largest 4-bit weight holds at once (model/nf4_torchao.py ``_dequantize``), ``rows_of``
    ranks holding a share of its rows each: the values in the compute dtype and, a chunk of ``DEQUANT_CHUNK``
    packed bytes at a time, their codes as int32 and the chunk's values looked up in the table (the compute
    dtype's), about 2.5 times the values alone in fp32, 3 times in bf16."""
    weights = f.dequant_bytes / f.compute_itemsize / rows_of
    packed = min(weights / 2, DEQUANT_CHUNK)
    return weights * f.compute_itemsize + packed * (4 + 2 * f.compute_itemsize)


def _head_terms(f: Facts, tokens: int, vocab: int, blocks: int, chunk_override: int = 0,
                piece: int = 0) -> tuple[float, float]:
    """What the output head and the loss add at the end of forward and at the start of backward.

    The loss head (train/loss_head.py) makes the logits of one chunk of tokens at a time, in fp32 (and in
    the compute dtype first when that is narrower), for one block of the vocabulary (a rank's rows under
    FSDP2's row-sharded head, else all of it); it keeps the derivative of each token's log-probability
    by its hidden state (tokens × hidden) for backward, plus a few fp32 values per token; over several
    blocks, running sums of tokens × hidden in fp32 and the compute dtype. Backward makes the hidden
    states' gradient from it. Scoring by exchange (``piece``: tokens per rank of one exchange, 0 when the
    rows are broadcast) holds, for every rank's tokens of a piece, their hidden states and the running
    sums, and logits of chunks of at most a piece, on this rank's rows only; after the rows are streamed,
    the derivative's shares sent and received take no more than that. Without the loss head (a trained or
    adapted head) the model's full logits exist, and the chunked cross-entropy (train/loss.py) works on
    them a fp32 chunk at a time."""
    item = f.compute_itemsize
    if f.chunked_head:
        chunk = min(tokens, loss_head_chunk(vocab, chunk_override or None))
        deriv = tokens * f.hidden * item
        per_token = tokens * 32  # the running log-sum-exp, target logit, best logit and token, results
        logit_chunk = min(chunk, piece or chunk) * -(-vocab // blocks) * (4 + (item if item < 4 else 0))
        if piece:
            gathered = blocks * piece  # and per gathered token its target, running state and every rank's 4 stats
            running = gathered * (f.hidden * (4 + 2 * item) + 32 + 16 * (blocks + 1))
        else:
            running = tokens * f.hidden * (4 + item) if blocks > 1 else chunk * f.hidden * (4 + item)
        return deriv + logit_chunk + running + per_token, 2 * deriv + chunk * f.hidden * 4
    logits = tokens * vocab * item
    # The loss works on one fp32 chunk of tokens at a time: logsumexp makes a temporary of the chunk's
    # size in forward; logits in a narrower dtype are first copied to fp32 a chunk at a time (fp32 logits
    # are used in place), and backward writes the gradient of the whole logits.
    chunk = min(CHUNK_BYTES, tokens * vocab * 4)
    upcast = chunk if item < 4 else 0
    return logits + upcast + chunk, 2 * logits + upcast


def row_tokens(cfg: Config, lengths: Lengths | None) -> int:
    """Tokens in each row of a step's widest micro-batch: packed rows are --seq-len long; unpacked ones
    are padded to their micro-batch's longest record, so at most the data's longest (``lengths``,
    after --seq-len; unknown: --seq-len). GRPO's rows are a prompt and a completion of up to
    --max-completion-length tokens."""
    completion = cfg.completion_room()
    if cfg.data.packing or lengths is None or not lengths.longest:
        return cfg.data.seq_len + completion
    return min(cfg.data.seq_len, lengths.longest) + completion


def default_budget(local_ranks: int, device: str) -> tuple[int | None, str]:
    """This machine's memory per rank on ``device`` ('cuda' or 'cpu': runtime/budget.py) and where the
    number came from; None when planning for GPUs on a machine without one."""
    if device == "cuda" and not torch.cuda.is_available():
        return None, "no GPU here: give --memory-per-rank to judge fits"
    return memory_per_rank(torch.device(device), local_ranks)


def default_memory_per_rank(local_ranks: int, device: str) -> int | None:
    """``default_budget``'s bytes."""
    return default_budget(local_ranks, device)[0]
