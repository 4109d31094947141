"""Options from YAML (flat or nested), the command line on top, and clear errors naming the option."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from shardtune.cli import _overrides, build_parser
from shardtune.config import Config, ConfigError, build_config, validate, write_yaml


def write(tmp_path, text: str, name: str = "run.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def from_cli(argv: list[str]) -> Config:
    args = build_parser().parse_args(["finetune", *argv])
    return build_config(args.config, _overrides(args))


def valid(**changes) -> Config:
    cfg = build_config({"model": "m", "data": "d.jsonl", "out": "o"})
    for key, value in changes.items():
        section = next(s for s in ("model", "lora", "data", "train", "parallel", "output")
                       if hasattr(getattr(cfg, s), key))
        setattr(getattr(cfg, section), key, value)
    return cfg


# --- YAML forms ---------------------------------------------------------------------------------

@pytest.mark.parametrize("text", ["lora-r: 16\n", "lora_r: 16\n", "lora:\n  r: 16\n"])
def test_yaml_forms_set_the_same_field(tmp_path, text):
    cfg = build_config(write(tmp_path, text))
    assert cfg.lora.r == 16
    assert isinstance(cfg.lora.r, int)
    # Nothing else moved from its default.
    default = Config()
    default.lora.r = 16
    assert cfg == default


def test_nested_sections_and_flat_keys_mix(tmp_path):
    cfg = build_config(write(tmp_path, (
        "model: /models/tiny\n"
        "data:\n  train: train.jsonl\n  seq_len: 64\n"
        "train:\n  batch-size: 4\n  lr: 1e-3\n"
        "parallel:\n  strategy: ddp\n  activation_checkpointing: true\n"
        "out: runs/x\n"
        "lora_targets: [q_proj, v_proj]\n"
    )))
    assert cfg.model.path == "/models/tiny"
    assert cfg.data.train == "train.jsonl" and cfg.data.seq_len == 64
    assert cfg.train.batch_size == 4
    assert cfg.train.lr == pytest.approx(1e-3) and isinstance(cfg.train.lr, float)  # YAML reads 1e-3 as a string
    assert cfg.parallel.strategy == "ddp" and cfg.parallel.activation_checkpointing is True
    assert cfg.output.out == "runs/x"
    assert cfg.lora.targets == "q_proj,v_proj"


def test_empty_yaml_gives_defaults(tmp_path):
    assert build_config(write(tmp_path, "")) == Config()


def test_dict_config_like_the_python_api():
    cfg = build_config({"lora_r": 4, "lora": {"alpha": 8}}, {"seq_len": 32})
    assert (cfg.lora.r, cfg.lora.alpha, cfg.data.seq_len) == (4, 8.0, 32)


# --- command line over YAML ---------------------------------------------------------------------

def test_cli_flags_override_yaml(tmp_path):
    path = write(tmp_path, "lora-r: 16\nlr: 0.01\nstrategy: fsdp1\nresume: true\nseq-len: 128\n")
    cfg = from_cli(["--config", str(path), "--lora-r", "4", "--strategy", "ddp", "--no-resume"])
    assert cfg.lora.r == 4
    assert cfg.parallel.strategy == "ddp"
    assert cfg.output.resume is False  # a flag can switch off what the file switched on
    # Options not given on the command line keep the file's value.
    assert cfg.train.lr == pytest.approx(0.01)
    assert cfg.data.seq_len == 128


def test_cli_alone_without_config():
    cfg = from_cli(["--model", "m", "--data", "d.jsonl", "--out", "o", "--batch-size", "2",
                    "--activation-checkpointing"])
    assert (cfg.model.path, cfg.data.train, cfg.output.out) == ("m", "d.jsonl", "o")
    assert cfg.train.batch_size == 2
    assert cfg.parallel.activation_checkpointing is True
    assert cfg.lora.r == Config().lora.r


def test_cli_rejects_bad_choice_and_type(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["finetune", "--strategy", "zero3"])
    assert "zero3" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["finetune", "--lora-r", "abc"])
    assert "--lora-r" in capsys.readouterr().err


# --- errors -------------------------------------------------------------------------------------

def test_unknown_key_suggests_the_closest_and_names_the_file(tmp_path):
    path = write(tmp_path, "lora_rank: 16\n")
    with pytest.raises(ConfigError) as err:
        build_config(path)
    msg = str(err.value)
    assert str(path) in msg
    assert "'lora_rank'" in msg
    assert "did you mean 'lora-r'" in msg


@pytest.mark.parametrize("key, suggestion", [("batchsize", "batch-size"), ("seq_length", "seq-len"),
                                             ("lerning-rate", None)])
def test_unknown_key_suggestions(tmp_path, key, suggestion):
    path = write(tmp_path, f"{key}: 1\n")
    with pytest.raises(ConfigError) as err:
        build_config(path)
    msg = str(err.value)
    assert str(path) in msg and key in msg
    if suggestion:
        assert f"did you mean '{suggestion}'" in msg
    else:
        assert "unknown option" in msg


def test_unknown_key_inside_a_section(tmp_path):
    path = write(tmp_path, "lora:\n  rank: 16\n")
    with pytest.raises(ConfigError, match=r"unknown option 'lora\.rank'.*did you mean 'lora-r'") as err:
        build_config(path)
    assert str(path) in str(err.value)


def test_section_name_given_a_scalar_is_explained(tmp_path):
    path = write(tmp_path, "lora: 16\n")
    with pytest.raises(ConfigError) as err:
        build_config(path)
    msg = str(err.value)
    assert str(path) in msg and "'lora'" in msg
    assert "did you mean 'lora'" not in msg  # suggesting the very key given helps nobody
    assert "section" in msg


def test_unknown_override_is_named_as_argument():
    with pytest.raises(ConfigError, match=r"arguments: unknown option 'lora_rnk'.*'lora-r'"):
        build_config({}, {"lora_rnk": 4})


@pytest.mark.parametrize("text, option", [
    ("lora-r: abc\n", "lora-r"),
    ("lora-r: 1.5\n", "lora-r"),
    ("lr: fast\n", "lr"),
    ("resume: maybe\n", "resume"),
    ("lora-r: true\n", "lora-r"),
])
def test_wrong_type_names_the_option(tmp_path, text, option):
    with pytest.raises(ConfigError, match=rf"option '{option}': expected"):
        build_config(write(tmp_path, text))


def test_bad_choice_names_the_option_and_the_choices(tmp_path):
    with pytest.raises(ConfigError) as err:
        build_config(write(tmp_path, "strategy: zero3\n"))
    msg = str(err.value)
    assert "option 'strategy'" in msg and "'zero3'" in msg
    assert "fsdp2" in msg and "ddp" in msg


def test_missing_and_malformed_config_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        build_config(tmp_path / "nope.yaml")
    path = write(tmp_path, "lora-r: [1,\n")
    with pytest.raises(ConfigError, match="not valid YAML") as err:
        build_config(path)
    assert str(path) in str(err.value)
    with pytest.raises(ConfigError, match="expected a mapping"):
        build_config(write(tmp_path, "- lora-r\n- 16\n", "list.yaml"))


# --- validate -----------------------------------------------------------------------------------

def test_validate_accepts_a_complete_config():
    validate(valid())


@pytest.mark.parametrize("changes, option", [
    ({"path": None}, "model"),
    ({"train": None}, "data"),
    ({"out": None}, "out"),
    ({"batch_size": 0}, "batch-size"),
    ({"r": 0}, "lora-r"),
    ({"seq_len": 0}, "seq-len"),
    ({"micro_batch_size": 0}, "micro-batch-size"),
    ({"steps": 0}, "steps"),
    ({"epochs": 0.0}, "epochs"),
    ({"lr": 0.0}, "lr"),
    ({"dropout": 1.0}, "lora-dropout"),
    ({"node_rank": 1}, "node-rank"),
    ({"nnodes": 2, "node_rank": 2, "rdzv_endpoint": "h:1"}, "node-rank"),
    ({"nnodes": 2, "node_rank": -1, "rdzv_endpoint": "h:1"}, "node-rank"),
    ({"nnodes": 2}, "rdzv-endpoint"),
    ({"cpu_offload": True, "strategy": "ddp"}, "cpu-offload"),
])
def test_validate_names_the_option(changes, option):
    with pytest.raises(ConfigError, match=rf"option '{option}'"):
        validate(valid(**changes))


def test_validate_multinode_ok_with_endpoint():
    validate(valid(nnodes=2, node_rank=1, rdzv_endpoint="node0:29500"))


def test_validate_without_data_needs_only_the_model():
    cfg = build_config({"model": "m"})
    validate(cfg, need_data=False)
    with pytest.raises(ConfigError, match="'data'"):
        validate(cfg)


# --- the resolved config.yaml -------------------------------------------------------------------

def test_flat_round_trips_through_write_yaml(tmp_path):
    cfg = from_cli(["--model", "/m", "--data", "t.jsonl", "--val-data", "v.json", "--out", "o", "--lora-r", "4",
                    "--lora-alpha", "3.5", "--lora-targets", "q_proj,v_proj", "--lora-modules-to-save", "lm_head",
                    "--steps", "7", "--lr", "1e-5", "--strategy", "ddp", "--activation-checkpointing",
                    "--nproc", "2", "--resume", "--dtype", "fp32", "--seq-len", "33"])
    path = tmp_path / "config.yaml"
    write_yaml(cfg, path)
    flat = yaml.safe_load(path.read_text())
    assert flat == cfg.flat()
    assert set(flat) == {f.metadata["flag"] for s in dataclasses.fields(Config)
                         for f in dataclasses.fields(getattr(cfg, s.name))}
    again = build_config(path)
    assert again == cfg
    assert again.flat() == cfg.flat()


def test_default_config_round_trips(tmp_path):
    path = tmp_path / "config.yaml"
    write_yaml(Config(), path)
    assert build_config(path) == Config()


def test_every_option_declares_what_resume_does_when_it_changes():
    """The resume policy lives with each option in the schema (train/resume_checks.py reads it): a new option
    without one fails here, not silently as 'warn' on someone's resume."""
    from shardtune.config import FLAGS, MUST_MATCH, RESUME_POLICIES, opt

    missing = [flag for flag, (_, f) in FLAGS.items() if f.metadata.get("resume") not in RESUME_POLICIES]
    assert missing == []
    structural = {flag for flag, (_, f) in FLAGS.items() if f.metadata["resume"] == MUST_MATCH}
    assert {"lora-r", "lora-targets", "lora-variant"} <= structural
    with pytest.raises(ValueError, match="resume policy 'maybe'"):
        opt(1, "x", "maybe", "help")
