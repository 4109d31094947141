"""Reading options into a ``Config``: a strict YAML loader, flat or nested keys, values coerced to
each option's type, and ``config.yaml`` written back.

A YAML file may use the flag names as flat keys (``lora-r: 16`` or ``lora_r: 16``) or nest them
by section (``lora: {r: 16}``); flags given on the command line override the file. Nothing here
judges whether values make sense together: that is ``rules.validate``.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

import yaml

from shardtune.config.options import FLAGS, SECTIONS, Config, ConfigError, all_fields, field_type
from shardtune.errors import read_text


def _coerce(flag: str, value: Any) -> Any:
    _, f = FLAGS[flag]
    if value is None:
        if "None" not in str(f.type):  # `lora-dropout:` left empty in YAML: no number to validate later
            raise ConfigError(f"option '{flag}': expected {field_type(f).__name__}, got nothing (null)")
        return None
    if f.metadata.get("auto") and isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    typ = field_type(f)
    try:
        if typ is bool and isinstance(value, str):
            if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError(value)
            value = value.lower() in ("true", "1", "yes")
        elif typ is list:  # a repeatable option: one value, or a list of them
            value = [str(v) for v in (value if isinstance(value, (list, tuple)) else [value])]
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
            section_fields = {f.name.replace("_", "-"): f for s, f in all_fields() if s == name}
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


def write_yaml(cfg: Config, path: Path) -> None:
    path.write_text(yaml.safe_dump(cfg.flat(), sort_keys=False))
