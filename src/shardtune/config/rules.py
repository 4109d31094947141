"""The rules about option values: ``validate`` (every check that needs no file read), ranges, which
options combine with which strategy (``combination_refusal``, from the traits in strategies.py),
sizes, the --data-fields mapping and the LoRA initialisations a sharded model cannot have.
"""

from __future__ import annotations

import math
import re
import urllib.parse

from shardtune.config.options import FLAGS, OBJECTIVES, Config, ConfigError
from shardtune.config.strategies import STRATEGIES, groups_refusal, traits


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
    refused = groups_refusal(cfg.parallel.replicate_groups, cfg.parallel.nproc * cfg.parallel.nnodes)
    if refused:
        raise ConfigError(f"{refused} (--nproc {cfg.parallel.nproc} x --nnodes {cfg.parallel.nnodes})")
    if cfg.parallel.memory_per_rank is not None:
        parse_size(cfg.parallel.memory_per_rank)
    refused = tile_refusal(cfg)
    if refused:
        raise ConfigError(refused)
    if cfg.train.eval_every and not cfg.data.val:
        raise ConfigError(f"option 'eval-every' ({cfg.train.eval_every}) validates on --val-data, which is not given: "
                          "give --val-data FILE, or leave --eval-every out")
    if cfg.parallel.strategy != "auto":
        refused = combination_refusal(cfg, cfg.parallel.strategy)
        if refused:
            raise ConfigError(refused)
    elif cfg.parallel.context_parallel not in (1, "auto"):  # whichever strategy auto picks: the ranks must split
        able = next(s for s, t in STRATEGIES.items() if t.context_parallel)
        refused = context_parallel_refusal(cfg, able, cfg.parallel.nproc * cfg.parallel.nnodes)
        if refused:
            raise ConfigError(refused)

    validate_preference(cfg)


def tile_refusal(cfg: Config) -> str | None:
    """Why --mlp-tile cuts nothing (None: it may): a tile of at least the tokens a rank's MLP sees of a row
    (--seq-len, with GRPO's completion, over the --context-parallel pieces) leaves every row whole, so the
    option would be silently ignored."""
    tile, seq_len = cfg.parallel.mlp_tile, cfg.data.seq_len
    if not isinstance(tile, int) or not isinstance(seq_len, int):  # auto, or plan's --seq-len max
        return None
    completion = cfg.completion_room()
    pieces = cfg.parallel.context_parallel if isinstance(cfg.parallel.context_parallel, int) else 1
    most = math.ceil((seq_len + completion) / max(pieces, 1))
    if tile < most:
        return None
    row = f"--seq-len {seq_len}" + (f" + --max-completion-length {completion}" if completion else "")
    over = f", over --context-parallel {pieces}" if pieces > 1 else ""
    return (f"option 'mlp-tile' ({tile}) cuts nothing: a rank's MLP sees at most {most} tokens of a row ({row}"
            f"{over}); use a tile below {most}, or leave --mlp-tile out (auto tiles where a run would not fit "
            "without)")


#: GRPO's options that correct for a vLLM sampler: refused without --vllm-url (the policy's own samples need none)
VLLM_ONLY = ("vllm-importance-sampling", "vllm-importance-sampling-max", "vllm-importance-sampling-min")

#: The options only some objectives read. One rule for all of them: set (to other than its default) under an
#: objective that does not read it, an option is refused, never silently ignored.
OBJECTIVE_OPTIONS = {"dpo-beta": ("dpo",), "dpo-loss": ("dpo",), "dpo-label-smoothing": ("dpo",),
                     "precompute-reference": ("dpo",), "orpo-lambda": ("orpo",), "simpo-beta": ("simpo",),
                     "simpo-gamma": ("simpo",),
                     **{flag: ("grpo",) for flag in ("reward", "reward-weights", "num-generations",
                                                     "max-completion-length", "temperature", "top-p", "top-k",
                                                     "mask-truncated-completions", "grpo-loss", "scale-rewards",
                                                     "epsilon", "epsilon-high", "grpo-beta", "num-iterations",
                                                     "importance-sampling", "vllm-url", "off-policy-mask-threshold",
                                                     *VLLM_ONLY)}}


def _given(cfg: Config, flag: str) -> bool:
    """Whether option ``flag`` is set to other than its default."""
    section, f = FLAGS[flag]
    return getattr(getattr(cfg, section), f.name) != f.default


def validate_preference(cfg: Config) -> None:
    pref = cfg.preference
    for flag, objectives in OBJECTIVE_OPTIONS.items():
        if cfg.train.objective not in objectives and _given(cfg, flag):
            raise ConfigError(f"option '{flag}' applies to --objective {' or '.join(objectives)} only, and this run "
                              f"is --objective {cfg.train.objective}, which would ignore it: leave it out, or set "
                              f"--objective {objectives[0]}")
    if pref.dpo_label_smoothing and pref.dpo_loss != "sigmoid":
        raise ConfigError(f"option 'dpo-label-smoothing' applies to --dpo-loss sigmoid, not {pref.dpo_loss}")
    if cfg.train.objective == "grpo":
        validate_grpo(cfg)


def validate_grpo(cfg: Config) -> None:
    """GRPO's rules that need no file read (the reward functions are loaded in preflight)."""
    g = cfg.grpo
    if not g.reward:
        raise ConfigError("option 'reward' is required with --objective grpo: give --reward path/to/file.py:name, "
                          "module:name or a built-in (exact_match, contains, format=REGEX, length=TOKENS); repeat "
                          "it for several")
    checked_reward_weights(g.reward_weights, len(g.reward))
    for flag, value, greedy in (("temperature", g.temperature, 0), ("top-k", g.top_k, 1)):
        if value == greedy:
            raise ConfigError(f"option '{flag}': --{flag} {greedy} samples greedily, so the {g.num_generations} "
                              "completions of a prompt come out alike, no group has an advantage and GRPO learns "
                              "nothing: sample (TRL's default --temperature 1, --top-k 0)")
    if cfg.train.batch_size % g.num_generations:
        raise ConfigError(f"option 'batch-size' ({cfg.train.batch_size}) counts completions under --objective grpo "
                          f"and must hold whole groups of --num-generations {g.num_generations}: use a multiple of "
                          f"{g.num_generations}")
    if g.vllm_url:
        validate_vllm_url(cfg)
    else:
        for flag in VLLM_ONLY:
            if _given(cfg, flag):
                raise ConfigError(f"option '{flag}' applies with --vllm-url only (it corrects the loss for a vLLM "
                                  "sampler's probabilities; the policy's own completions need no correction): leave "
                                  "it out, or give --vllm-url")
    if g.off_policy_mask_threshold is not None and g.num_iterations == 1 and not g.vllm_url:
        raise ConfigError(f"option 'off-policy-mask-threshold' ({g.off_policy_mask_threshold:g}) masks completions "
                          "the policy has drifted from since they were sampled; with --num-iterations 1 and no "
                          "--vllm-url the policy being trained is the one that sampled them, so it would never mask "
                          "one (as in TRL): give --num-iterations 2 or more, or --vllm-url, or leave it out")
    if cfg.data.val:
        raise ConfigError("option 'val-data' does not apply to --objective grpo (a loss on held-out prompts means "
                          "little): measure held-out prompts with `shardtune eval --reward ...` instead")


def validate_vllm_url(cfg: Config) -> None:
    """--vllm-url's form, and the options its adapter-only sync cannot serve (whether the server answers is
    preflight's check)."""
    url = str(cfg.grpo.vllm_url)
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"option 'vllm-url': {url!r} is no server address: give http://HOST:PORT of a vLLM "
                          "OpenAI-compatible server (vllm serve MODEL --enable-lora)")
    lora = cfg.lora
    # what vLLM's LoRA loader refuses (its PEFTHelper): the adapter would fail to load mid-run
    unserved = [what for what, used in (("--lora-variant dora", lora.variant == "dora"),
                                        (f"--lora-bias {lora.bias}", lora.bias != "none"),
                                        ("--lora-modules-to-save", bool(lora.modules_to_save.strip())))
                if used]
    if unserved:
        raise ConfigError(f"option 'vllm-url': vLLM's runtime LoRA loading does not take adapters with "
                          f"{' or '.join(unserved)} (it serves plain LoRA A/B only): leave {unserved[0].split()[0]} "
                          "out, or leave out --vllm-url for the policy to generate itself")
    g = cfg.grpo
    low, high = g.vllm_importance_sampling_min, g.vllm_importance_sampling_max
    if low is not None and high is not None and low >= high:
        raise ConfigError(f"option 'vllm-importance-sampling-min' ({low:g}) must be less than "
                          f"--vllm-importance-sampling-max ({high:g})")
    if g.loss == "vespo" and g.vllm_importance_sampling.startswith("sequence"):
        raise ConfigError(f"option 'vllm-importance-sampling': --grpo-loss vespo weighs whole sequences itself and "
                          f"takes the correction per token only (as TRL): use token_truncate or token_mask, or off, "
                          f"not {g.vllm_importance_sampling}")


def checked_reward_weights(text: str | None, functions: int) -> list[float] | None:
    """--reward-weights for ``functions`` --reward functions (finetune's and eval's): one finite number each, not
    all 0 (None: 1 each); ConfigError naming the option otherwise."""
    weights = reward_weights(text)
    if weights is not None and len(weights) != functions:
        raise ConfigError(f"option 'reward-weights' has {len(weights)} weights for {functions} --reward "
                          "functions: give one weight per function")
    if weights is not None and not any(weights):
        raise ConfigError(f"option 'reward-weights' ({text}) weighs every --reward 0: every completion's reward "
                          "would be 0, which measures nothing and teaches GRPO nothing; give at least one function "
                          "a weight")
    return weights


def reward_weights(text: str | None) -> list[float] | None:
    """--reward-weights as numbers (None: 1 each); ConfigError naming the option for anything else."""
    if text is None or not str(text).strip():
        return None
    out = []
    for part in str(text).split(","):
        try:
            value = float(part)
        except ValueError:
            raise ConfigError(f"option 'reward-weights': {part.strip()!r} is not a number (give e.g. 1,0.5)") from None
        if not math.isfinite(value):
            raise ConfigError(f"option 'reward-weights': {part.strip()!r} is not a finite number")
        out.append(value)
    return out


NF4_FSDP1 = ("option 'quantize': nf4 is not supported with --strategy fsdp1 (its flat parameters cannot hold "
             "4-bit tensors); use --strategy fsdp2 (which gathers the 4-bit data), ddp or single")
DORA_FSDP1 = ("option 'lora-variant': dora does not work under --strategy fsdp1 (DoRA reads its base layer's "
              "weight outside that layer's FSDP1 unit); use fsdp2, ddp or single")

GRPO_FSDP1 = ("option 'objective': grpo samples its completions with the policy, a forward per token, which "
              "--strategy fsdp1's flat parameters do not run; use fsdp2 (sharded like fsdp1), ddp or single")


def combination_refusal(cfg: Config, strategy: str, ranks: int | None = None) -> str | None:
    """Why ``strategy`` cannot run ``cfg`` (None: it can): every rule about which options combine, once,
    read from the strategies' traits (strategies.py).

    ``validate`` refuses a strategy given by name with it, the automatic choice skips the strategies it
    refuses, ``shardtune plan`` prints it on their rows, and no run plan is made without passing it.
    ``ranks``: the ranks the strategy would run on (default: --nproc × --nnodes).
    """
    ranks = cfg.parallel.nproc * cfg.parallel.nnodes if ranks is None else ranks
    t = traits(strategy)
    if t.one_process and ranks > 1:
        return (f"option 'strategy': {strategy} runs one process, but {ranks} ranks were asked for "
                "(--nproc × --nnodes); use ddp, fsdp2 or fsdp1, or --nproc 1")
    if cfg.model.quantize == "nf4" and not t.nf4:
        return NF4_FSDP1
    if cfg.lora.variant == "dora" and not t.dora:
        return DORA_FSDP1
    if cfg.train.objective == "grpo" and not t.generates:
        return GRPO_FSDP1
    if cfg.parallel.replicate_groups > 1:
        if not t.hsdp:
            return f"option 'replicate-groups' needs an FSDP strategy, not '{strategy}'"
        refused = groups_refusal(cfg.parallel.replicate_groups, ranks)
        if refused:
            return refused
    if cfg.parallel.cpu_offload and not t.cpu_offload:
        return f"option 'cpu-offload' needs an FSDP strategy, not '{strategy}'"
    if t.fsdp_unit and cfg.parallel.fsdp_unit == "part" and cfg.parallel.mlp_tile not in (None, "auto", 0):
        return (f"option 'mlp-tile' ({cfg.parallel.mlp_tile}) goes with whole-layer units: with --fsdp-unit part "
                "every tile would gather the MLP's projections again, and their recomputation in backward does not "
                "match its forward; use --fsdp-unit layer (or auto), or leave --mlp-tile out")
    return context_parallel_refusal(cfg, strategy, ranks)


#: the objectives context parallelism splits: their loss is a sum over target tokens, or a function of
#: per-sequence sums (which the ranks of a CP group add up before it). Not GRPO: each rank samples and
#: trains on completions of its own (train/rollout.py), which the ranks of a CP group would have to share.
CP_OBJECTIVES = tuple(o for o in OBJECTIVES if o != "grpo")


def context_parallel_refusal(cfg: Config, strategy: str, ranks: int) -> str | None:
    """Why --context-parallel cannot run with ``strategy`` on ``ranks`` ranks (None: it can, or it is 1).
    What the model must allow (its attention, its heads) is model/attention.py's ``check_context_parallel``."""
    n, groups = cfg.parallel.context_parallel, cfg.parallel.replicate_groups
    if n in (1, "auto"):  # 'auto' weighs only the sizes this rule allows (train/choice.py)
        return None
    if not traits(strategy).context_parallel:
        able = " or ".join(s for s, t in STRATEGIES.items() if t.context_parallel)
        return (f"option 'context-parallel' ({n}) needs --strategy {able} (weights sharded over every rank, "
                f"each sequence over a group of {n}); '{strategy}' cannot carry it: use --strategy {able}, "
                "or leave --context-parallel out")
    refused = context_ranks_refusal(n, ranks, groups)
    if refused:
        return refused
    if cfg.train.objective not in CP_OBJECTIVES:
        return (f"option 'context-parallel' does not split --objective {cfg.train.objective}; it splits "
                f"{', '.join(CP_OBJECTIVES)}: leave --context-parallel out")
    return None


def context_ranks_refusal(n: int, ranks: int, groups: int = 1, flags: str = "--nproc × --nnodes") -> str | None:
    """Why groups of ``n`` consecutive ranks cannot cut ``ranks`` ranks (``groups`` replica groups of them)
    into context-parallel groups (None: they can): fine-tuning's rule and ``shardtune eval``'s (``flags``:
    the options that gave the ranks)."""
    fits = [d for d in range(2, ranks + 1) if ranks % d == 0 and (ranks // groups) % d == 0]
    hint = f"use one of {', '.join(map(str, fits))}" if fits else "use more ranks (--nproc)"
    if ranks % n:
        return f"option 'context-parallel': {n} does not divide the {ranks} ranks ({flags}); {hint}"
    if groups > 1 and (ranks // groups) % n:
        return (f"option 'context-parallel': {n} does not divide the {ranks // groups} ranks of each of the "
                f"--replicate-groups {groups} groups (a sequence's pieces stay within a group); {hint}")
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

def validate_lora_init(init: str) -> None:
    name = init.lower()
    family = next((k for k in REFUSED_INITS if name.startswith(k)), None)
    if family:
        raise ConfigError(f"option 'lora-init': {init!r} is not supported: it {REFUSED_INITS[family]}, while every "
                          f"rank holds only its shard; use one of {', '.join(LORA_INITS)}")
    if name not in LORA_INITS:
        raise ConfigError(f"option 'lora-init': {init!r} is not one of {', '.join(LORA_INITS)}")
