"""The option schema: every option of a fine-tune, in one typed dataclass per section.

Each field carries its command-line flag, help text, resume policy, accepted range and whether it
may be 'auto' in its metadata (``opt``), so the CLI, the YAML config file and the ``config.yaml``
written to the output directory all come from here. Reading values into a ``Config`` is
``reading.py``; the rules about values and their combinations are ``rules.py``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from typing import Any

from shardtune.config.strategies import FSDP_UNITS, STRATEGY_CHOICES
from shardtune.errors import ShardtuneError


class ConfigError(ShardtuneError, ValueError):
    """A configuration problem the user must fix; the message says which option and why."""


#: --objective values: sft on records, dpo/orpo/simpo on preference pairs, grpo on prompts (online RL)
OBJECTIVES = ("sft", "dpo", "orpo", "simpo", "grpo")
#: --grpo-loss values, as TRL 1.16's loss_type (train/grpo_loss.py implements each)
GRPO_LOSSES = ("grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo")
#: --vllm-importance-sampling values: off, or TRL 1.16's vllm_importance_sampling_mode (train/sampler_correction.py)
VLLM_IS_MODES = ("off", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


@dataclass(frozen=True)
class Range:
    """The values a numeric option accepts: ``low``..``high``, each end inclusive unless marked open."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def __contains__(self, value: float) -> bool:
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)

    def describe(self) -> str:
        if self.low is not None and self.high is not None:
            return f"in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}{')' if self.high_open else ']'}"
        if self.low is not None:
            return f"{'greater than' if self.low_open else 'at least'} {self.low:g}"
        return f"{'less than' if self.high_open else 'at most'} {self.high:g}"


#: the ranges most options share
AT_LEAST_1, AT_LEAST_0, POSITIVE = Range(1), Range(0), Range(0, low_open=True)


#: What ``--resume`` does when an option differs from the checkpoint's run (train/resume_checks.py):
FREE = "free"  # continue without a word: where and how the run computes, not what it computes
WARN = "warn"  # continue, saying which option changed: the continuation is another run from there on
MUST_MATCH = "must-match"  # refuse before loading: it decides which tensors the checkpoint holds
RESUME_POLICIES = (FREE, WARN, MUST_MATCH)


def opt(default: Any, flag: str, resume: str, help: str, choices: tuple[str, ...] | None = None,
        auto: bool = False, range: Range | None = None) -> Any:
    """A config field; ``resume``: its policy on --resume (one of RESUME_POLICIES); ``auto``: the value
    may also be the word "auto" (chosen before the run starts); ``range``: the values a numeric option
    accepts, checked by ``validate`` (every numeric option has one)."""
    if resume not in RESUME_POLICIES:
        raise ValueError(f"option '{flag}': resume policy {resume!r} is not one of {', '.join(RESUME_POLICIES)}")
    return field(default=default, metadata={"flag": flag, "help": help, "choices": choices, "auto": auto,
                                            "resume": resume, "range": range})


@dataclass
class ModelConfig:
    path: str | None = opt(
        None, "model", WARN, "Hugging Face model directory (config.json + *.safetensors + tokenizer) or Hub id "
        "org/name[@revision] (local path first, then the HF cache, then a download unless HF_HUB_OFFLINE=1)."
    )
    dtype: str = opt(
        "auto", "dtype", WARN,
        "Dtype of the frozen base weights and of compute; fp16 (GPUs without bf16: T4, V100) adds loss scaling. "
        "auto: bf16 where the hardware computes in it natively (Ampere+ GPUs, CPUs with AVX512/AMX), else fp16 "
        "on GPUs and fp32 on CPUs.",
        ("auto", "bf16", "fp16", "fp32"),
    )
    quantize: str = opt(
        "none", "quantize", WARN, "Store the frozen decoder-layer Linear weights in 4-bit NormalFloat (QLoRA; needs "
        "torchao; fsdp2, ddp or single).", ("none", "nf4")
    )
    trust_remote_code: bool = opt(
        False, "trust-remote-code", WARN,
        "Allow a model whose config names its own Python code (auto_map); runs that code."
    )


@dataclass
class LoraConfig:
    r: int = opt(8, "lora-r", MUST_MATCH, "LoRA rank.", range=AT_LEAST_1)
    alpha: float = opt(16.0, "lora-alpha", WARN, "LoRA scaling numerator (scale = alpha / r).", range=POSITIVE)
    dropout: float = opt(0.0, "lora-dropout", WARN, "Dropout on the LoRA input.", range=Range(0, 1, high_open=True))
    targets: str = opt("all-linear", "lora-targets", MUST_MATCH,
        "Comma-separated module names to adapt, or 'all-linear'.")
    bias: str = opt("none", "lora-bias", MUST_MATCH,
        "Which biases train: none, all, or lora_only.", ("none", "all", "lora_only"))
    modules_to_save: str = opt(
        "", "lora-modules-to-save", MUST_MATCH, "Comma-separated modules trained in full (e.g. lm_head)."
    )
    variant: str = opt(
        "lora", "lora-variant", MUST_MATCH,
        "lora, or dora (weight-decomposed LoRA: a trained magnitude per output row).",
        ("lora", "dora"),
    )
    rslora: bool = opt(False, "lora-rslora", WARN, "Rank-stabilised scaling: alpha / sqrt(r) instead of alpha / r.")
    init: str = opt(
        "default", "lora-init", WARN, "LoRA A initialisation: default (Kaiming uniform, as peft) or gaussian; "
        "B starts at zero either way."
    )
    init_adapter: str | None = opt(
        None, "init-adapter", WARN, "Continue training this peft adapter directory (e.g. the SFT stage's adapter/) "
        "instead of a fresh LoRA; its r, alpha and targets must match the LoRA options. Under a preference "
        "objective the reference is then base + this adapter."
    )


@dataclass
class DataConfig:
    train: str | None = opt(
        None, "data", WARN, "Training data: .jsonl/.json, .parquet, .csv, a save_to_disk directory or a cached Hub "
        "dataset name; instruction, messages, text or ShareGPT (conversations) records."
    )
    val: str | None = opt(None, "val-data", FREE, "Validation data in the same formats.")
    seq_len: int = opt(512, "seq-len", WARN, "Tokens per record; longer records are truncated (and counted).",
        range=AT_LEAST_1)
    packing: bool = opt(
        False, "packing", WARN, "Pack several records into each sequence of up to --seq-len tokens (attention and "
        "positions stay per record); --micro-batch-size then counts packed sequences per forward."
    )
    fields: str = opt(
        "", "data-fields", WARN, "Column mapping onto the record fields, e.g. prompt=question,response=answer "
        "(fields: prompt, input, response, messages, text, conversations, chosen, rejected)."
    )


@dataclass
class TrainConfig:
    steps: int | None = opt(None, "steps", WARN, "Optimizer steps (default: --epochs 1).", range=AT_LEAST_1)
    epochs: float | None = opt(None, "epochs", WARN, "Passes over the training data (when --steps is not given).",
        range=POSITIVE)
    batch_size: int = opt(8, "batch-size", WARN, "Global batch: records per optimizer step over all ranks.",
        range=AT_LEAST_1)
    micro_batch_size: int | str | None = opt(
        None, "micro-batch-size", FREE, "Records per forward pass on one rank (default: batch-size / ranks, fewer "
        "when that does not fit the memory a rank may use); with --packing, packed sequences per forward; 'auto': "
        "the largest that fits --memory-per-rank.", auto=True,
        range=AT_LEAST_1)
    lr: float = opt(2e-4, "lr", WARN, "Peak learning rate (AdamW).", range=POSITIVE)
    weight_decay: float = opt(0.0, "weight-decay", WARN, "AdamW weight decay.", range=AT_LEAST_0)
    warmup_steps: int | None = opt(
        None, "warmup-steps", WARN, "Linear warmup steps before the cosine decay (default: 10% of steps, at most 100).",
            range=AT_LEAST_0)
    min_lr_ratio: float = opt(0.1, "min-lr-ratio", WARN, "Final learning rate as a fraction of --lr.",
        range=Range(0, 1))
    max_grad_norm: float = opt(1.0, "max-grad-norm", WARN, "Clip the global gradient norm to this (0 disables).",
        range=AT_LEAST_0)
    seed: int = opt(0, "seed", WARN, "Seed for LoRA init, shuffling and dropout.", range=Range(0, 2**32 - 1))
    eval_every: int = opt(0, "eval-every", FREE, "Validation every N steps (0: only at the end; needs --val-data).",
        range=AT_LEAST_0)
    objective: str = opt(
        "sft", "objective", WARN, "What to learn: sft (next-token loss on responses), from preference pairs "
        "(prompt, chosen, rejected): dpo, orpo or simpo, or grpo (online RL from prompts and --reward functions; "
        "docs/grpo.md).", OBJECTIVES,
    )


@dataclass
class PreferenceConfig:
    """The preference objectives' knobs; defaults as TRL's (DPOConfig, ORPOConfig, CPOConfig)."""

    dpo_beta: float = opt(0.1, "dpo-beta", WARN, "DPO: β, how far the policy may move from the reference (IPO: τ).",
                          range=POSITIVE)
    dpo_label_smoothing: float = opt(
        0.0, "dpo-label-smoothing", WARN, "DPO (sigmoid): the share of pairs assumed mislabelled (conservative DPO).",
        range=Range(0, 0.5, high_open=True))
    dpo_loss: str = opt(
        "sigmoid", "dpo-loss", WARN, "DPO's loss: sigmoid (the DPO paper) or ipo (squared, per-token log-ratios).",
        ("sigmoid", "ipo"),
    )
    orpo_lambda: float = opt(0.1, "orpo-lambda", WARN, "ORPO: λ, the weight of the odds-ratio term next to the NLL.",
                             range=AT_LEAST_0)
    simpo_beta: float = opt(0.1, "simpo-beta", WARN, "SimPO: β, the scale of the length-normalised reward.",
                            range=POSITIVE)
    simpo_gamma: float = opt(0.5, "simpo-gamma", WARN, "SimPO: γ, the target reward margin.", range=AT_LEAST_0)
    precompute_reference: bool = opt(
        False, "precompute-reference", FREE, "DPO: compute every pair's reference log-probs once before training "
        "(stored beside the token cache); steps then skip the reference forward."
    )


@dataclass
class GrpoConfig:
    """GRPO's knobs (--objective grpo); names and defaults as TRL 1.16's GRPOConfig (docs/grpo.md)."""

    reward: list[str] | None = opt(
        None, "reward", WARN, "GRPO: a reward function, TRL's convention fn(prompts, completions, **fields): "
        "path/to/file.py:name, module:name, or a built-in (exact_match[=FIELD], contains[=FIELD], format=REGEX, "
        "length=TOKENS); repeat the option for several (from Python, also the functions themselves).")
    reward_weights: str | None = opt(
        None, "reward-weights", WARN, "GRPO: comma-separated weights, one per --reward (default 1 each).")
    num_generations: int = opt(8, "num-generations", WARN, "GRPO: completions sampled per prompt (a group); "
                               "--batch-size counts completions, so it must be a multiple of this.", range=Range(2))
    max_completion_length: int = opt(256, "max-completion-length", WARN,
                                     "GRPO: tokens a completion may have (it ends at EOS or here).", range=AT_LEAST_1)
    temperature: float = opt(1.0, "temperature", WARN, "GRPO: sampling temperature, above 0 (greedy sampling gives "
                             "every completion of a prompt alike: nothing to learn).", range=AT_LEAST_0)
    top_p: float = opt(1.0, "top-p", WARN, "GRPO: nucleus sampling; 1 keeps every token.",
                       range=Range(0, 1, low_open=True))
    top_k: int = opt(0, "top-k", WARN, "GRPO: sample among the k most likely tokens (0: off; 1 would be greedy).",
                     range=AT_LEAST_0)
    mask_truncated_completions: bool = opt(
        False, "mask-truncated-completions", WARN, "GRPO: completions cut by --max-completion-length count no "
        "token in the loss (they are still counted in completions/clipped_ratio).")
    loss: str = opt("dapo", "grpo-loss", WARN, "GRPO: the loss's normalisation, as TRL's loss_type (dapo: one "
                    "mean over every token of the batch; grpo: per-sequence means; dr_grpo: / max length).",
                    GRPO_LOSSES)
    scale_rewards: str = opt("group", "scale-rewards", WARN, "GRPO: advantages divided by the std of the group's "
                             "rewards, of the batch's, or not at all (Dr. GRPO).", ("group", "batch", "none"))
    epsilon: float = opt(0.2, "epsilon", WARN, "GRPO: the ratio is clipped below at 1 - epsilon.",
                         range=AT_LEAST_0)
    epsilon_high: float | None = opt(None, "epsilon-high", WARN, "GRPO: the ratio is clipped above at "
                                     "1 + epsilon-high (DAPO's clip-higher: 0.28) [default: --epsilon].",
                                     range=AT_LEAST_0)
    beta: float = opt(0.0, "grpo-beta", WARN, "GRPO: weight of the KL to the reference (the base with the adapter "
                      "off, or the --init-adapter model); 0: no reference forward.", range=AT_LEAST_0)
    num_iterations: int = opt(1, "num-iterations", WARN, "GRPO: optimizer steps on each generation batch "
                              "(μ; > 1 keeps the old policy's log-probs for the ratio).", range=AT_LEAST_1)
    importance_sampling: str = opt("token", "importance-sampling", WARN, "GRPO: the ratio per token, or per "
                                   "sequence (GSPO).", ("token", "sequence"))
    vllm_url: str | None = opt(
        None, "vllm-url", WARN, "GRPO: sample the completions with a vLLM server at this URL (http://host:port) "
        "instead of the policy itself; after each optimizer step only the adapter is written and loaded through "
        "its runtime LoRA endpoint, checked served (docs/grpo.md).")
    vllm_importance_sampling: str = opt(
        "sequence_mask", "vllm-importance-sampling", WARN, "GRPO with --vllm-url: the loss reweighted by the ratio "
        "of the trainer's to vLLM's probability of the sampled tokens (TRL's vLLM importance-sampling correction), "
        "per token or per sequence, a ratio outside [min, max] truncated to it or masked to 0; off: none.",
        VLLM_IS_MODES)
    vllm_importance_sampling_max: float | None = opt(
        3.0, "vllm-importance-sampling-max", WARN, "GRPO with --vllm-url: the correction's upper bound C_max "
        "(null in a YAML config: none).", range=POSITIVE)
    vllm_importance_sampling_min: float | None = opt(
        None, "vllm-importance-sampling-min", WARN, "GRPO with --vllm-url: the correction's lower bound C_min.",
        range=AT_LEAST_0)
    off_policy_mask_threshold: float | None = opt(
        None, "off-policy-mask-threshold", WARN, "GRPO: off-policy sequence masking (DeepSeek-V3.2, TRL's "
        "off_policy_mask_threshold δ): a completion with a negative advantage gets no policy loss when its mean "
        "per-token log-ratio of the sampling policy (the old policy's, or vLLM's with --vllm-url) to the current "
        "one exceeds δ (e.g. 0.5); needs --num-iterations > 1 or --vllm-url.", range=POSITIVE)


@dataclass
class ParallelConfig:
    nproc: int = opt(1, "nproc", FREE, "Worker processes to start on this node (one per GPU on GPU machines).",
        range=AT_LEAST_1)
    strategy: str = opt(
        "auto", "strategy", FREE, "How to split the model over ranks.", STRATEGY_CHOICES
    )
    activation_checkpointing: bool = opt(
        False, "activation-checkpointing", FREE,
        "Recompute each decoder layer's activations in backward (also switched "
        "on by --strategy/--micro-batch-size auto when nothing fits without it)."
    )
    fsdp_unit: str = opt(
        "auto", "fsdp-unit", FREE,
        "FSDP2's unit of sharding: whole decoder layers (fewer, larger collectives: faster) or "
        "their parts (attention and MLP projections: a lower peak); auto: layers when they fit --memory-per-rank.",
        ("auto", *FSDP_UNITS),
    )
    memory_per_rank: str | None = opt(
        None, "memory-per-rank", FREE, "Memory one rank may use, e.g. 8GiB or 3000MB, for the automatic choices and "
        "`plan` [default: this GPU's memory, or available RAM / local ranks]."
    )
    cpu_offload: bool = opt(False, "cpu-offload", FREE, "Keep sharded parameters on CPU (FSDP only).")
    mlp_tile: int | str | None = opt(
        "auto", "mlp-tile", FREE,
        "Long context: compute each decoder layer's MLP this many tokens at a time, recomputed tile by tile in "
        "backward, so one tile's intermediate exists instead of the whole sequence's (one more MLP forward per "
        "layer). auto: tiles of hidden-size tokens, only when the run does not fit --memory-per-rank without.",
        auto=True, range=AT_LEAST_1)
    loss_chunk: int | None = opt(
        None, "loss-chunk", FREE,
        "Tokens the loss head scores at a time (it never holds the whole sequence's logits) [default: as many "
        "as fill 64 MiB of fp32 logits].", range=AT_LEAST_1)
    activation_offload: bool = opt(
        False, "activation-offload", FREE,
        "GPUs: keep what a forward saves for backward (with --activation-checkpointing: each layer's input) in "
        "pinned host memory, copied out and back on a side stream, overlapped with compute. On CPU it changes "
        "nothing.")
    device: str = opt(
        "auto", "device", FREE,
        "Where ranks compute: auto (cuda when a GPU is visible), cpu, or cuda (one GPU per rank).",
        ("auto", "cpu", "cuda"),
    )
    replicate_groups: int = opt(
        1, "replicate-groups", FREE,
        "HSDP: replica groups (normally --nnodes); each group of ranks/R shards the model, the groups replicate it.",
        range=AT_LEAST_1)
    context_parallel: int | str = opt(
        1, "context-parallel", FREE,
        "Context parallelism: cut every sequence into N pieces, one per rank of a group of N consecutive ranks "
        "(attention across the pieces by an all-to-all over heads), so each rank holds about 1/N of a sequence's "
        "activations and logits: a longer context. N must divide the ranks; --strategy fsdp2 (weights sharded over "
        "all ranks); models on shardtune's attention (those that run sdpa through transformers). 'auto': the "
        "smallest N with which a step fits --memory-per-rank, 1 when it fits without.", auto=True, range=AT_LEAST_1)
    nnodes: int = opt(1, "nnodes", FREE, "Number of nodes (multi-node runs).", range=AT_LEAST_1)
    node_rank: int = opt(0, "node-rank", FREE, "This node's index among --nnodes.", range=AT_LEAST_0)
    collective_timeout: float = opt(
        300.0, "collective-timeout", FREE, "Seconds a rank waits for the others in one collective (or for the "
        "other nodes to join) before the run stops and names the rank that went silent.",
        range=Range(0, 7 * 86400, True),
    )
    rdzv_endpoint: str | None = opt(None, "rdzv-endpoint", FREE,
        "HOST:PORT of the rendezvous (node 0) for multi-node runs.")


@dataclass
class OutputConfig:
    out: str | None = opt(
        None, "out", FREE, "Output directory (config.yaml, metrics.jsonl, summary.json, adapter/, checkpoints/)."
    )
    save_every: int = opt(0, "save-every", FREE, "Write a resumable checkpoint every N steps (0: never).",
        range=AT_LEAST_0)
    keep_last: int = opt(2, "keep-last", FREE, "Resumable checkpoints to keep.", range=AT_LEAST_1)
    resume: bool = opt(False, "resume", FREE, "Continue from the newest complete checkpoint under --out.")
    overwrite: bool = opt(
        False, "overwrite", FREE, "Start a new run in an --out that holds a finished or interrupted one (its "
        "checkpoints are deleted; its adapter and summary are replaced when the new run finishes)."
    )
    allow_data_change: bool = opt(
        False, "allow-data-change", FREE,
        "With --resume: continue although the training data file changed since the checkpoint (size or SHA-256).",
    )
    log_file: str | None = opt(None, "log-file", FREE, "Also write every rank's log lines to this file.")
    report_to: str = opt(
        "", "report-to", WARN, "Experiment trackers, comma-separated: tensorboard, wandb, mlflow (rank 0 logs each "
        "step's metrics, the config and the summary; --resume continues the same tracker run)."
    )


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    preference: PreferenceConfig = field(default_factory=PreferenceConfig)
    grpo: GrpoConfig = field(default_factory=GrpoConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    output: OutputConfig = field(default_factory=OutputConfig)

    def completion_room(self) -> int:
        """Tokens a row holds after its --seq-len part: GRPO's completion of up to --max-completion-length; 0
        under the other objectives, whose rows are their records."""
        return self.grpo.max_completion_length if self.train.objective == "grpo" else 0

    def flat(self) -> dict[str, Any]:
        """The options keyed by flag name: what ``config.yaml`` holds (as the user gave them: what ``auto``
        chose is the run plan's) and ``--config`` reads back."""
        return {f.metadata["flag"]: getattr(getattr(self, s), f.name) for s, f in all_fields()}


def all_fields() -> list[tuple[str, dataclasses.Field]]:
    out = []
    for section in fields(Config):
        for f in fields(section.type if not isinstance(section.type, str) else globals()[section.type]):
            out.append((section.name, f))
    return out


FLAGS: dict[str, tuple[str, dataclasses.Field]] = {f.metadata["flag"]: (s, f) for s, f in all_fields()}
SECTIONS = {f.name for f in fields(Config)}


def field_type(f: dataclasses.Field) -> type:
    """The Python type an option's values have: bool, int, float, str, or list (of str: a repeatable flag)."""
    text = str(f.type)
    for name, typ in (("bool", bool), ("int", int), ("float", float), ("list", list)):
        if text.startswith(name):
            return typ
    return str
