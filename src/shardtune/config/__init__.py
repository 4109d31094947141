"""Every option of a fine-tune (ground floor): the schema, reading it, and the rules about its values.

- ``options.py``: the schema: one typed dataclass per section, each field with its flag, help text,
  resume policy and accepted range;
- ``reading.py``: a YAML file or dict plus overrides into a ``Config`` (strict YAML, flat or nested
  keys, values coerced to each option's type), and ``config.yaml`` written back;
- ``rules.py``: ``validate`` (every check that needs no file read), ranges, which options combine with
  which strategy (``combination_refusal``), sizes, --data-fields, LoRA inits;
- ``strategies.py``: each strategy's traits (``STRATEGIES``), the one place that knows strategies by
  name, beside the rule built on them.

The names below are the package's public interface: ``from shardtune.config import X`` works for
each, whichever module holds it.
"""

from __future__ import annotations

from shardtune.config.options import (
    FLAGS,
    FREE,
    MUST_MATCH,
    OBJECTIVES,
    RESUME_POLICIES,
    SECTIONS,
    WARN,
    Config,
    ConfigError,
    DataConfig,
    GrpoConfig,
    LoraConfig,
    ModelConfig,
    OutputConfig,
    ParallelConfig,
    PreferenceConfig,
    Range,
    TrainConfig,
    field_type,
    opt,
)
from shardtune.config.reading import build_config, flatten, read_yaml, write_yaml
from shardtune.config.rules import (
    FIELDS,
    LORA_INITS,
    REFUSED_INITS,
    check_ranges,
    checked_reward_weights,
    combination_refusal,
    context_ranks_refusal,
    parse_fields,
    parse_size,
    reward_weights,
    validate,
    validate_lora_init,
    validate_preference,
)
from shardtune.config.strategies import (
    FSDP_UNITS,
    NO_UNIT,
    STRATEGIES,
    Traits,
    groups_refusal,
    ranks_of,
    traits,
    unit_of,
    units_to_try,
)

__all__ = [
    "FIELDS", "FLAGS", "FREE", "FSDP_UNITS", "NO_UNIT", "STRATEGIES", "Traits", "groups_refusal", "ranks_of",
    "traits", "unit_of", "units_to_try", "LORA_INITS", "MUST_MATCH", "OBJECTIVES", "REFUSED_INITS", "RESUME_POLICIES",
    "SECTIONS", "WARN", "Config", "ConfigError", "DataConfig", "GrpoConfig", "LoraConfig", "ModelConfig",
    "OutputConfig",
    "ParallelConfig", "PreferenceConfig", "Range", "TrainConfig", "build_config", "check_ranges",
    "combination_refusal", "context_ranks_refusal", "field_type", "flatten", "opt", "parse_fields", "parse_size",
    "reward_weights", "checked_reward_weights", "read_yaml",
    "validate", "validate_lora_init", "validate_preference", "write_yaml",
]
