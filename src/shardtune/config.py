"""Every option of a fine-tune, in one typed dataclass per section.

Each field carries its command-line flag and help text in its metadata, so the CLI, the YAML
config file and the resolved ``config.yaml`` written to the output directory all come from here.
A YAML file may use the flag names as flat keys (``lora-r: 16`` or ``lora_r: 16``) or nest them
by section (``lora: {r: 16}``); flags given on the command line override the file.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from shardtune.errors import ShardtuneError, read_text


class ConfigError(ShardtuneError, ValueError):
    """A configuration problem the user must fix; the message says which option and why."""


#: --objective values; every one but sft trains on preference pairs
OBJECTIVES = ("sft", "dpo", "orpo", "simpo")


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


#: What ``--resume`` does when an option differs from the checkpoint's run (train/checkpoint.py):
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
        None, "micro-batch-size", FREE, "Records per forward pass on one rank (default: batch-size / ranks); with "
        "--packing, packed sequences per forward; 'auto': the largest that fits --memory-per-rank.", auto=True,
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
        "sft", "objective", WARN, "What to learn: sft (next-token loss on responses), or from preference pairs "
        "(prompt, chosen, rejected): dpo, orpo or simpo.", OBJECTIVES,
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
class ParallelConfig:
    nproc: int = opt(1, "nproc", FREE, "Worker processes to start on this node (one per GPU on GPU machines).",
        range=AT_LEAST_1)
    strategy: str = opt(
        "auto", "strategy", FREE, "How to split the model over ranks.", ("auto", "fsdp2", "fsdp1", "ddp", "single")
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
        ("auto", "layer", "part"),
    )
    memory_per_rank: str | None = opt(
        None, "memory-per-rank", FREE, "Memory one rank may use, e.g. 8GiB or 3000MB, for the automatic choices and "
        "`plan` [default: this GPU's memory, or available RAM / local ranks]."
    )
    chosen: str = opt("", "chosen", FREE,
        "Written by shardtune into config.yaml: what the automatic choice picked and why.")
    cpu_offload: bool = opt(False, "cpu-offload", FREE, "Keep sharded parameters on CPU (FSDP only).")
    device: str = opt(
        "auto", "device", FREE,
        "Where ranks compute: auto (cuda when a GPU is visible), cpu, or cuda (one GPU per rank).",
        ("auto", "cpu", "cuda"),
    )
    replicate_groups: int = opt(
        1, "replicate-groups", FREE,
        "HSDP: replica groups (normally --nnodes); each group of ranks/R shards the model, the groups replicate it.",
        range=AT_LEAST_1)
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
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    output: OutputConfig = field(default_factory=OutputConfig)

    def flat(self) -> dict[str, Any]:
        """The options keyed by flag name: what ``config.yaml`` holds and ``--config`` reads back."""
        return {f.metadata["flag"]: getattr(getattr(self, s), f.name) for s, f in _all_fields()}


def _all_fields() -> list[tuple[str, dataclasses.Field]]:
    out = []
    for section in fields(Config):
        for f in fields(section.type if not isinstance(section.type, str) else globals()[section.type]):
            out.append((section.name, f))
    return out


FLAGS: dict[str, tuple[str, dataclasses.Field]] = {f.metadata["flag"]: (s, f) for s, f in _all_fields()}
SECTIONS = {f.name for f in fields(Config)}


def _field_type(f: dataclasses.Field) -> type:
    text = str(f.type)
    for name, typ in (("bool", bool), ("int", int), ("float", float)):
        if text.startswith(name):
            return typ
    return str


def _coerce(flag: str, value: Any) -> Any:
    _, f = FLAGS[flag]
    if value is None:
        if "None" not in str(f.type):  # `lora-dropout:` left empty in YAML: no number to validate later
            raise ConfigError(f"option '{flag}': expected {_field_type(f).__name__}, got nothing (null)")
        return None
    if f.metadata.get("auto") and isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    typ = _field_type(f)
    try:
        if typ is bool and isinstance(value, str):
            if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError(value)
            value = value.lower() in ("true", "1", "yes")
        elif typ is str and isinstance(value, (list, tuple)):
            value = ",".join(str(v) for v in value)
        elif typ is int and isinstance(value, float) and not value.is_integer():
            raise ValueError(value)
        elif typ in (int, float) and isinstance(value, bool):
            raise ValueError(value)  # YAML reads yes/no/on/off as booleans: never a number
        value = typ(value)
    except (TypeError, ValueError):
        raise ConfigError(f"option '{flag}': expected {typ.__name__}, got {value!r}") from None
    choices = f.metadata["choices"]
    if choices and value not in choices:
        raise ConfigError(f"option '{flag}': {value!r} is not one of {', '.join(choices)}")
    return value


def _unknown(key: str, where: str) -> ConfigError:
    name = key.replace("_", "-").replace(".", "-")
    # A flag the key starts with ('lora-r' for 'lora-rank') beats a merely similar one ('lora-variant').
    close = sorted((f for f in FLAGS if name.startswith(f)), key=len)[-1:] or \
        difflib.get_close_matches(name, list(FLAGS) + sorted(SECTIONS), n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    return ConfigError(f"{where}: unknown option '{key}'{hint}")


def flatten(raw: dict[str, Any], where: str) -> dict[str, Any]:
    """Turn a YAML/dict config (flat flag keys or nested sections) into {flag: value}; an option given
    twice (``lora-r`` and ``lora_r``, or ``lora-r`` and ``lora: {r}``) is refused: one would be ignored."""
    flat: dict[str, Any] = _Once(where)
    for key, value in raw.items():
        name = str(key).replace("_", "-")
        if name in SECTIONS and isinstance(value, dict):
            section_fields = {f.name.replace("_", "-"): f for s, f in _all_fields() if s == name}
            for sub, sub_value in value.items():
                sub_name = str(sub).replace("_", "-")
                if sub_name not in section_fields:
                    raise _unknown(f"{name}.{sub}", where)
                flat[section_fields[sub_name].metadata["flag"]] = sub_value
        elif name in FLAGS:
            flat[name] = value
        elif name in SECTIONS:
            raise ConfigError(f"{where}: '{key}' is a section: give it a mapping of its options, not {value!r}")
        else:
            raise _unknown(str(key), where)
    return dict(flat)


class _Once(dict):
    """A dict refusing a second value for a key: the options of one config file or call."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.where = where

    def __setitem__(self, key: str, value: Any) -> None:
        if key in self:
            raise ConfigError(f"{self.where}: option '{key}' is given twice (as flag name, field name or in its "
                              "section); keep one")
        super().__setitem__(key, value)


class _DuplicateKey(yaml.YAMLError):
    def __init__(self, key: object, line: int, first: int) -> None:
        super().__init__(f"key '{key}' appears twice (lines {first} and {line})")
        self.key, self.line, self.first = key, line, first


class _StrictLoader(yaml.SafeLoader):
    """YAML's safe loader, except that a mapping with the same key twice is an error: PyYAML keeps
    the last value silently, so the first (often the one the user edited) would be ignored."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[object, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                if key in seen:
                    raise _DuplicateKey(key, line, seen[key])
            except TypeError:  # an unhashable key: the base class says so
                break
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _StrictLoader.construct_mapping)


def read_yaml(path: str | Path) -> dict[str, Any]:
    text = read_text(path, "config file", ConfigError)
    try:
        raw = yaml.load(text, Loader=_StrictLoader) or {}  # noqa: S506 - a SafeLoader
    except _DuplicateKey as err:
        raise ConfigError(f"{path}:{err.line}: option '{err.key}' is given twice (first on line {err.first}); "
                          "keep one") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of options, got {type(raw).__name__}")
    return raw


def build_config(
    base: str | Path | dict[str, Any] | None = None, overrides: dict[str, Any] | None = None
) -> Config:
    """Config from a YAML path or dict, then ``overrides`` ({flag or field: value}) on top."""
    flat: dict[str, Any] = {}
    if isinstance(base, (str, Path)):
        flat.update(flatten(read_yaml(base), str(base)))
    elif base:
        flat.update(flatten(dict(base), "config"))
    if overrides:
        flat.update(flatten({k: v for k, v in overrides.items() if v is not None}, "arguments"))
    cfg = Config()
    for flag, value in flat.items():
        section, f = FLAGS[flag]
        setattr(getattr(cfg, section), f.name, _coerce(flag, value))
    return cfg


def validate(cfg: Config, need_data: bool = True) -> None:
    """All checks that need no files read, in one place; raise ConfigError naming the option."""
    if not cfg.model.path:
        raise ConfigError("option 'model' is required: a Hugging Face model directory")
    if need_data and not cfg.data.train:
        raise ConfigError("option 'data' is required: a .jsonl or .json training file")
    if need_data and not cfg.output.out:
        raise ConfigError("option 'out' is required: the output directory")
    check_ranges(cfg)
    validate_lora_init(cfg.lora.init)
    parse_fields(cfg.data.fields)
    if not 0 <= cfg.parallel.node_rank < cfg.parallel.nnodes:
        raise ConfigError(f"option 'node-rank' must be in [0, {cfg.parallel.nnodes}), got {cfg.parallel.node_rank}")
    if cfg.parallel.nnodes > 1 and not cfg.parallel.rdzv_endpoint:
        raise ConfigError("option 'rdzv-endpoint' (HOST:PORT of node 0) is required with --nnodes > 1")
    ranks = cfg.parallel.nproc * cfg.parallel.nnodes
    if cfg.parallel.replicate_groups > 1:
        if ranks % cfg.parallel.replicate_groups:
            raise ConfigError(f"option 'replicate-groups': {cfg.parallel.replicate_groups} groups do not divide "
                              f"the {ranks} ranks (--nproc {cfg.parallel.nproc} x --nnodes {cfg.parallel.nnodes})")
    if cfg.parallel.memory_per_rank is not None:
        parse_size(cfg.parallel.memory_per_rank)
    if cfg.train.eval_every and not cfg.data.val:
        raise ConfigError(f"option 'eval-every' ({cfg.train.eval_every}) validates on --val-data, which is not given: "
                          "give --val-data FILE, or leave --eval-every out")
    if cfg.parallel.strategy != "auto":
        refused = combination_refusal(cfg, cfg.parallel.strategy)
        if refused:
            raise ConfigError(refused)

    validate_preference(cfg)


#: The options only some objectives read. One rule for all of them: set (to other than its default) under an
#: objective that does not read it, an option is refused, never silently ignored.
OBJECTIVE_OPTIONS = {"dpo-beta": ("dpo",), "dpo-loss": ("dpo",), "dpo-label-smoothing": ("dpo",),
                     "precompute-reference": ("dpo",), "orpo-lambda": ("orpo",), "simpo-beta": ("simpo",),
                     "simpo-gamma": ("simpo",)}


def validate_preference(cfg: Config) -> None:
    pref = cfg.preference
    for flag, objectives in OBJECTIVE_OPTIONS.items():
        section, f = FLAGS[flag]
        if cfg.train.objective not in objectives and getattr(getattr(cfg, section), f.name) != f.default:
            raise ConfigError(f"option '{flag}' applies to --objective {' or '.join(objectives)} only, and this run "
                              f"is --objective {cfg.train.objective}, which would ignore it: leave it out, or set "
                              f"--objective {objectives[0]}")
    if pref.dpo_label_smoothing and pref.dpo_loss != "sigmoid":
        raise ConfigError(f"option 'dpo-label-smoothing' applies to --dpo-loss sigmoid, not {pref.dpo_loss}")


def combination_refusal(cfg: Config, strategy: str, ranks: int | None = None) -> str | None:
    """Why ``strategy`` cannot run ``cfg`` (None: it can): every rule about which options combine, once.

    ``validate`` refuses a strategy given by name with it, the automatic choice skips the strategies it
    refuses, ``plan`` prints it on their rows, and the run plan is never made without passing it.
    ``ranks``: the ranks the strategy would run on (default: --nproc × --nnodes).
    """
    ranks = cfg.parallel.nproc * cfg.parallel.nnodes if ranks is None else ranks
    replicated = strategy in ("ddp", "single")
    if strategy == "single" and ranks > 1:
        return (f"option 'strategy': single runs one process, but {ranks} ranks were asked for "
                "(--nproc × --nnodes); use ddp, fsdp2 or fsdp1, or --nproc 1")
    if cfg.model.quantize == "nf4" and strategy == "fsdp1":
        return ("option 'quantize': nf4 is not supported with --strategy fsdp1 (its flat parameters cannot hold "
                "4-bit tensors); use --strategy fsdp2 (which gathers the 4-bit data), ddp or single")
    if cfg.lora.variant == "dora" and strategy == "fsdp1":
        return DORA_FSDP1
    if cfg.parallel.replicate_groups > 1 and replicated:
        return f"option 'replicate-groups' needs an FSDP strategy, not '{strategy}'"
    if cfg.parallel.cpu_offload and replicated:
        return f"option 'cpu-offload' needs an FSDP strategy, not '{strategy}'"
    return None


def check_ranges(cfg: Config) -> None:
    """Every numeric option against the range its field declares: the one place they are checked, so
    that no optimizer, tokenizer or torch constructor is the first to see a bad value."""
    for flag, (section, f) in FLAGS.items():
        value = getattr(getattr(cfg, section), f.name)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue  # None (the default) and 'auto' are decided later
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"option '{flag}' must be a finite number, got {value}")
        allowed = f.metadata["range"]
        if allowed is not None and value not in allowed:
            raise ConfigError(f"option '{flag}' must be {allowed.describe()}, got {value}")


_UNITS = {"": 1, "b": 1, "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4,
          "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4,
          "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}

def parse_size(text: str) -> int:
    """Bytes from '8GiB', '8000MB', '1.5G' (KB/MB/GB: powers of 1000; K/M/G and KiB/MiB/GiB: of 1024)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text or "")
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ConfigError(f"option 'memory-per-rank': cannot read {text!r} as a size (e.g. 8GiB, 8000MB, 16G)")
    return int(float(match.group(1)) * _UNITS[unit])


#: --data-fields names → the record field they fill
FIELDS = {"prompt": "instruction", "instruction": "instruction", "input": "input", "response": "output",
          "output": "output", "messages": "messages", "text": "text", "conversations": "conversations",
          "chosen": "chosen", "rejected": "rejected"}

def parse_fields(spec: str | None) -> dict[str, str]:
    """{record field: column} from ``prompt=question,response=answer``."""
    mapping: dict[str, str] = {}
    for part in (spec or "").split(","):
        if not part.strip():
            continue
        name, sep, column = (s.strip() for s in part.partition("="))
        if not sep or not column or name not in FIELDS:
            raise ConfigError(f"option 'data-fields': {part.strip()!r} is not FIELD=COLUMN with FIELD one of "
                              f"{', '.join(FIELDS)}")
        mapping[FIELDS[name]] = column
    return mapping


LORA_INITS = ("default", "gaussian")
#: peft initialisations that read or rewrite whole base weights, or need data: impossible shard by shard.
REFUSED_INITS = {
    "pissa": "an SVD of each whole base weight, which it also rewrites",
    "olora": "a QR decomposition of each whole base weight, which it also rewrites",
    "loftq": "quantizes and decomposes each whole base weight",
    "corda": "needs data and each whole base weight",
    "eva": "needs data (activations) before training",
    "lora_ga": "needs gradients from data before training",
    "orthogonal": "reads each whole base weight",
    "mica": "an SVD of each whole base weight",
}
DORA_FSDP1 = (
    "option 'lora-variant': dora does not work under --strategy fsdp1 (DoRA reads its base layer's weight "
    "outside that layer's FSDP1 unit); use fsdp2, ddp or single"
)


def validate_lora_init(init: str) -> None:
    name = init.lower()
    family = next((k for k in REFUSED_INITS if name.startswith(k)), None)
    if family:
        raise ConfigError(f"option 'lora-init': {init!r} is not supported: it {REFUSED_INITS[family]}, while every "
                          f"rank holds only its shard; use one of {', '.join(LORA_INITS)}")
    if name not in LORA_INITS:
        raise ConfigError(f"option 'lora-init': {init!r} is not one of {', '.join(LORA_INITS)}")


def write_yaml(cfg: Config, path: Path) -> None:
    path.write_text(yaml.safe_dump(cfg.flat(), sort_keys=False))
