"""Property: whatever config values and data records a user gives, the outcome is success or a ShardtuneError
(exit 2 from the CLI) whose message names the input at fault, never another exception (a traceback)."""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from shardtune.config import FLAGS, ConfigError, build_config, validate
from shardtune.errors import ShardtuneError
from shardtune.train.data.checks import data_warnings
from shardtune.train.data.records import DataError
from shardtune.train.data.tokenize import load_dataset

from tiny import make_tokenizer

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-10**30, max_value=10**30),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12))
values = st.one_of(scalars, st.lists(scalars, max_size=3), st.dictionaries(st.text(max_size=5), scalars, max_size=2))
keys = st.one_of(st.sampled_from(sorted(FLAGS)), st.sampled_from(sorted(FLAGS)).map(lambda k: k.replace("-", "_")),
                 st.text(min_size=1, max_size=10))


@SETTINGS
@given(st.dictionaries(keys, values, max_size=8))
@example({"lr": float("nan")})
@example({"steps": float("inf"), "lora_r": 10**30})
def test_random_config_values_pass_or_name_the_option(options):
    # A model is given, so that a bad value is judged itself, not refused first for the missing model
    options = {"model": "m", **options}
    try:
        cfg = build_config(options)
        validate(cfg, need_data=False)
        assert all(math.isfinite(v) for v in cfg.flat().values() if isinstance(v, float)), "non-finite accepted"
    except ConfigError as err:
        message = str(err)
        named = [k for k in options if f"'{k}" in message or f"'{str(k).replace('_', '-')}" in message]
        assert named, message
    except Exception as err:  # anything else would reach the user as a traceback
        raise AssertionError(f"{type(err).__name__}: {err} for {options!r}") from err


@pytest.mark.parametrize("flag", ["lr", "weight-decay", "min-lr-ratio", "max-grad-norm", "lora-alpha", "epochs"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_number_is_refused_naming_its_option(flag, value):
    with pytest.raises(ConfigError, match=f"option '{flag}'"):
        validate(build_config({"model": "m", flag: value}), need_data=False)


json_values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                           st.dictionaries(st.text(max_size=8), inner, max_size=3)),
                           max_leaves=8)
fields = st.sampled_from(["instruction", "input", "output", "text", "messages", "role", "content", "other"])
messages = st.lists(st.one_of(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "wizard"]),
                                                     "content": st.text(max_size=20)}),
                              json_values), max_size=3)
records = st.one_of(
    json_values,
    st.dictionaries(fields, st.one_of(st.text(max_size=20), json_values), max_size=4),
    st.fixed_dictionaries({"messages": messages}),
    st.fixed_dictionaries({"instruction": st.text(max_size=20), "output": st.text(max_size=20)}),
)
lines = st.one_of(records.map(lambda r: json.dumps(r).encode()), st.binary(max_size=20), st.just(b""))


@SETTINGS
@given(st.lists(lines, max_size=6), st.booleans(), st.integers(min_value=1, max_value=40))
@example([b'{"messages": [{"role": "assistant", "content": ""}]}'], False, 1)  # the template refused: was a traceback
@example([b'{"text": "caf\xe9"}'], False, 8)
def test_malformed_data_records_load_or_name_the_file(raw_lines, as_array, seq_len):
    tokenizer = make_tokenizer()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / ("data.json" if as_array else "data.jsonl")
        if as_array:
            path.write_bytes(b"[" + b",".join(raw_lines) + b"]")
        else:
            path.write_bytes(b"\n".join(raw_lines))
        try:
            data = load_dataset(path, tokenizer, seq_len)
        except DataError as err:
            assert str(path) in str(err), str(err)
            return
        except ShardtuneError as err:
            raise AssertionError(f"not a DataError: {err}") from err
        except Exception as err:
            raise AssertionError(f"{type(err).__name__}: {err} for {raw_lines!r}") from err
        assert data.examples and all(e.targets > 0 for e in data.examples)
        data_warnings(path, [], len(data.examples), 8)
