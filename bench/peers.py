"""One rank of one benchmark job: shardtune or a peer recipe, measured the same way.

Started by bench/memory.py as ``python -m torch.distributed.run --nproc-per-node 2 bench/peers.py
RECIPE --model DIR --data FILE --out DIR``; each rank writes ``OUT/rank<r>.json``.

Recipes (each as people write it, shortest faithful form):
  shardtune   ``shardtune.train.recipe.run``: meta build, shard, read only the local slices (--strategy).
  naive       every rank ``from_pretrained`` → peft → ``fully_shard`` per decoder layer + root.
  broadcast   accelerate's FSDP2 ``cpu_ram_efficient_loading``: rank 0 ``from_pretrained``, the others
              build on meta; the model goes to meta, ``fully_shard``, then every tensor of rank 0's
              state dict is broadcast and ``distribute_tensor``-ed (``fsdp2_load_full_state_dict``).
  fsdp1-orig-params  FSDP1 with a plain decoder-layer policy and ``use_orig_params=True``.
  fsdp1-peft  accelerate's FSDP1: every rank ``from_pretrained`` → peft → FSDP1 with peft's
              ``fsdp_auto_wrap_policy`` and ``use_orig_params=True`` (its rank-0-only loading,
              ``sync_module_states=True``, refuses CPU parameters).
Memory is shardtune's own ``MemoryMonitor`` (peak RssAnon + RssShmem per phase) for every recipe; file bytes
read (load phase) are read() bytes (/proc/self/io rchar) plus each checkpoint file's peak mapped pages.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from shardtune.model.structure import decoder_layers, layer_classes
from shardtune.runtime.memory import MB


class FileReads:
    """Bytes this process read from the model files: read() calls (rchar, all files) plus, per
    checkpoint file, the peak of its pages mapped in (safetensors are often memory-mapped, not read;
    files are mapped one after another, so the peaks add up). Sampled: a lower bound."""

    def __init__(self, model_dir: str) -> None:
        self.prefix = str(Path(model_dir).resolve())
        self.rchar0, self.own = self._rchar(), 0
        self.mapped_peak: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    @staticmethod
    def _rchar() -> int:
        with open("/proc/self/io") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))

    def _sample_mapped(self) -> None:
        now: dict[str, int] = {}
        path = None
        with open("/proc/self/smaps") as f:
            text = f.read()
        self.own += len(text)  # our own reads of smaps count in rchar too
        for line in text.splitlines():
            if line[0] in "0123456789abcdef" and "-" in line.split(" ", 1)[0]:  # a mapping's first line
                path = line.split()[-1] if line.endswith(".safetensors") and self.prefix in line else None
            elif path and line.startswith("Rss:"):
                now[path] = now.get(path, 0) + int(line.split()[1])
        for path, kb in now.items():
            self.mapped_peak[path] = max(self.mapped_peak.get(path, 0), kb)

    def _sample(self) -> None:
        # Reading smaps walks the page tables of every mapping (about 60 ms with a 1.1B checkpoint mapped):
        # sampled every 25 ms it took most of a core from the load it measures. Waiting 9x as long as
        # the last sample took keeps this thread under a tenth of the time.
        wait = 0.025
        while not self._stop.wait(wait):
            started = time.perf_counter()
            self._sample_mapped()
            wait = max(0.025, 9 * (time.perf_counter() - started))

    def mb(self) -> float:
        self._stop.set()
        self._thread.join()
        self._sample_mapped()
        return ((self._rchar() - self.rchar0 - self.own) + sum(self.mapped_peak.values()) * 1024) / MB


def lora_config():
    from peft import LoraConfig

    return LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")


DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def full_model(path: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype)


def meta_model(path: str, dtype: torch.dtype):
    """What transformers builds on non-main ranks under accelerate: weights on meta, buffers real."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=dtype)


def shard_fsdp2(model, dtype: torch.dtype):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for layer in decoder_layers(model):
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    return model


def load_naive(path: str, rank: int, dtype: torch.dtype):
    from peft import get_peft_model

    return shard_fsdp2(get_peft_model(full_model(path, dtype), lora_config()), dtype)


def load_broadcast(path: str, rank: int, dtype: torch.dtype):
    from peft import get_peft_model
    from torch.distributed.tensor import distribute_tensor

    model = get_peft_model(full_model(path, dtype) if rank == 0 else meta_model(path, dtype), lora_config())
    full_sd = model.state_dict() if rank == 0 else None
    buffers = {n: b.clone() for n, b in model.named_buffers()}  # non-persistent: not in the state dict
    model = shard_fsdp2(model.to("meta"), dtype)
    sharded = {}
    for name, meta in model.state_dict().items():
        full = full_sd[name].detach() if rank == 0 else torch.empty(meta.shape, dtype=meta.dtype)
        dist.broadcast(full, src=0)
        sharded[name] = distribute_tensor(full, meta.device_mesh, meta.placements)
        del full
    del full_sd
    model.load_state_dict(sharded, assign=True)
    for name, value in buffers.items():
        module, _, attr = name.rpartition(".")
        model.get_submodule(module).register_buffer(attr, value, persistent=False)
    return model


def load_fsdp1_peft(path: str, rank: int, dtype: torch.dtype):
    from peft import get_peft_model
    from peft.utils.other import fsdp_auto_wrap_policy
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import MixedPrecision

    # Every rank loads: accelerate's rank-0-only variant (sync_module_states=True) refuses CPU
    # parameters ("requires them to be on GPU").
    model = get_peft_model(full_model(path, dtype), lora_config())
    return FSDP(
        model, auto_wrap_policy=fsdp_auto_wrap_policy(model), use_orig_params=True,
        device_id=torch.device("cpu"), limit_all_gathers=True,
        mixed_precision=MixedPrecision(param_dtype=dtype, reduce_dtype=torch.float32),
    )


def load_fsdp1_orig_params(path: str, rank: int, dtype: torch.dtype):
    from peft import get_peft_model
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import MixedPrecision
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    # The usual way around "Must flatten tensors with uniform requires_grad": a plain decoder-layer
    # policy with use_orig_params=True, which keeps gradients for whole flat parameters, frozen included.
    model = get_peft_model(full_model(path, dtype), lora_config())
    # One flat parameter must have one dtype: peft's fp32 LoRA weights go bf16 with the layer they sit in.
    model.to(dtype)
    return FSDP(
        model, auto_wrap_policy=ModuleWrapPolicy(layer_classes(model)), use_orig_params=True,
        device_id=torch.device("cpu"), limit_all_gathers=True,
        mixed_precision=MixedPrecision(param_dtype=dtype, reduce_dtype=torch.float32),
    )


def load_torchtune_nf4(path: str, rank: int, dtype: torch.dtype):
    """torchtune's QLoRA loading: every rank reads the whole bf16 state dict into memory, quantizes the
    decoder layers' Linear weights with ``to_nf4`` (default blocks 64/256), then ``fully_shard``."""
    from peft import get_peft_model
    from safetensors.torch import load_file

    from shardtune.model.nf4_torchao import nf4_module

    to_nf4 = nf4_module().to_nf4
    sd: dict[str, torch.Tensor] = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        sd.update(load_file(file))
    model = meta_model(path, dtype)
    model.load_state_dict(sd, strict=False, assign=True)  # the stored bf16 tensors
    del sd
    linears = {id(m) for layer in model.model.layers for m in layer.modules() if type(m) is torch.nn.Linear}
    # One tensor at a time (a whole fp32 copy of a 7B model would not fit two ranks): the layers' Linear
    # weights quantized from the compute dtype, everything else cast to it.
    for name, param in list(model.named_parameters()):
        owner_name, _, attr = name.rpartition(".")
        owner = model.get_submodule(owner_name)
        value = param.detach().to(dtype)
        if attr == "weight" and id(owner) in linears:
            value = to_nf4(value)
        setattr(owner, attr, torch.nn.Parameter(value, requires_grad=False))
    model.tie_weights()
    return shard_fsdp2(get_peft_model(model, lora_config()), dtype)


PEERS = {"naive": load_naive, "broadcast": load_broadcast, "fsdp1-peft": load_fsdp1_peft,
         "fsdp1-orig-params": load_fsdp1_orig_params, "torchtune-nf4": load_torchtune_nf4}


def run_peer(recipe: str, args: argparse.Namespace, rank: int, world: int) -> dict:
    from transformers import AutoTokenizer

    from shardtune.runtime import distributed
    from shardtune.runtime.memory import MemoryMonitor
    from shardtune.train.data.batch import collate
    from shardtune.train.data.tokenize import load_dataset

    d = distributed.init_worker()
    memory = MemoryMonitor(d.device)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    examples = load_dataset(args.data, tokenizer, args.seq_len).examples
    reads = FileReads(args.model)
    started = time.perf_counter()
    with memory.phase("load"):
        model = PEERS[recipe](args.model, rank, DTYPES[args.dtype])
    load_seconds = time.perf_counter() - started
    read_mb = reads.mb()
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    losses, tokens, started = [], 0, time.perf_counter()
    m = args.micro_batch_size  # records per step on each rank, padded to the longest (the usual collation)
    with memory.phase("train"):
        for step in range(args.steps):
            records = [examples[((step * world + rank) * m + i) % len(examples)] for i in range(m)]
            batch = collate(records, tokenizer.pad_token_id, d.device)
            # accelerate runs FSDP1's bf16 mixed precision under autocast: peft casts LoRA's input to the
            # fp32 weight's dtype outside the LoRA unit, and FSDP1 computes the unit in bf16
            autocast = recipe.startswith("fsdp1") and args.dtype == "bf16"
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                             labels=batch["labels"]).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
            tokens += int(batch["attention_mask"].sum())  # real tokens, not padding
    train_seconds = time.perf_counter() - started
    memory.close()
    result = {"load_peak_mb": memory.peak_mb("load"), "train_peak_mb": memory.peak_mb("train"),
              "load_seconds": load_seconds, "tokens_per_second": tokens * world / train_seconds,
              "read_mb": read_mb, "loss_first": losses[0], "loss_last": losses[-1]}
    distributed.teardown()
    return result


def run_shardtune(args: argparse.Namespace, rank: int) -> dict:
    import shardtune.train.job
    from shardtune.config import build_config, validate
    from shardtune.launch import launch

    reads: list[float] = []
    build_model = shardtune.train.job.build_model  # where the recipe's setup builds the model

    def counted_build_model(*a, **kw):  # the load phase: count its file reads, as for the peers
        counter = FileReads(args.model)
        try:
            return build_model(*a, **kw)
        finally:
            reads.append(counter.mb())

    shardtune.train.job.build_model = counted_build_model

    micro = "auto" if args.micro_batch_size == 0 else args.micro_batch_size
    world = int(os.environ["WORLD_SIZE"])
    # nproc as `shardtune finetune --nproc` sets it: --strategy auto chooses for this many ranks
    cfg = build_config({"model": args.model, "data": args.data, "out": str(Path(args.out) / "run"),
                        "nproc": world, "strategy": args.strategy, "steps": args.steps,
                        "batch-size": world * (args.batch_per_rank or args.micro_batch_size),
                        "micro-batch-size": micro, "seq-len": args.seq_len, "lora-r": 8, "lora-alpha": 16,
                        "lora-targets": "q_proj,v_proj", "activation-checkpointing": args.activation_checkpointing,
                        "cpu-offload": args.cpu_offload, "warmup-steps": 0, "packing": args.packing,
                        "fsdp-unit": args.fsdp_unit, "memory-per-rank": args.memory_per_rank,
                        "quantize": args.quantize, "dtype": args.dtype})
    validate(cfg)
    from shardtune.preflight import preflight

    cfg, plan = preflight(cfg)  # the run plan, as `shardtune finetune` resolves it
    summary = launch(cfg, plan)  # under torchrun: this rank's worker, as `torchrun -m shardtune.train` would run
    return {"load_peak_mb": summary["load_peak_mb"][rank], "train_peak_mb": summary["train_peak_mb"][rank],
            "load_seconds": summary["load_seconds"], "tokens_per_second": summary["tokens_per_second"],
            "read_mb": reads[0], "loss_first": summary["train_loss_first"], "loss_last": summary["train_loss_last"],
            "fill_ratio": summary.get("fill_ratio"), "chosen": plan.why or None}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("recipe", choices=["shardtune", *PEERS])
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--strategy", default="fsdp2")
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument("--cpu-offload", action="store_true")
    parser.add_argument("--micro-batch-size", type=int, default=1, help="records per forward per rank (0: auto)")
    parser.add_argument("--batch-per-rank", type=int, default=0, help="records per step per rank [micro-batch]")
    parser.add_argument("--packing", action="store_true")
    parser.add_argument("--fsdp-unit", default="part", choices=("auto", "layer", "part"))
    parser.add_argument("--memory-per-rank", default=None)
    parser.add_argument("--quantize", default="none")
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES),
                        help="compute dtype (and the peers' weights); fp32 on CPUs without bf16 matmul (AVX2 only)")
    args = parser.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # Imported before any counting starts, the same for every recipe: module files are not the model's.
    import peft.utils.other  # noqa: F401
    import torch.distributed.checkpoint  # noqa: F401
    import transformers.models.llama.modeling_llama  # noqa: F401

    import shardtune.train.recipe  # noqa: F401

    torch.set_num_threads(1)  # 2 ranks on 2 cores: the same for every recipe
    result = run_shardtune(args, rank) if args.recipe == "shardtune" else run_peer(args.recipe, args, rank, world)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
