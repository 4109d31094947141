"""--model as a Hub id: local path first, then the Hugging Face cache, then a download; never the network here."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from shardtune.model.directory import ModelDirError, check_model_dir
from shardtune.model.footprint import checkpoint_bytes
from shardtune.model.hub import HubModelError, parse_hub_id
from shardtune.runtime.safetensors_header import read_header

import cli_process
from tiny import instruction_records, make_model, write_jsonl

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def cache_layout(hub_cache: Path, repo_id: str, source: Path, commit: str = COMMIT, kind: str = "models") -> Path:
    """The layout huggingface_hub writes: refs/main names the commit, snapshots/<commit> holds the files."""
    repo = hub_cache / f"{kind}--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    shutil.copytree(source, snapshot)
    return snapshot


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("hub") / "model", "llama", sharded=True)


@pytest.fixture
def offline_cache(tmp_path: Path, monkeypatch) -> Path:
    import huggingface_hub.constants as constants

    cache = tmp_path / "hf" / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def test_parse_hub_id() -> None:
    assert parse_hub_id("org/name") == ("org/name", None)
    assert parse_hub_id("HuggingFaceTB/SmolLM2-135M@v1.0") == ("HuggingFaceTB/SmolLM2-135M", "v1.0")
    assert parse_hub_id("./org/name") is None
    assert parse_hub_id("/abs/path") is None
    assert parse_hub_id("a/b/c") is None
    assert parse_hub_id("plain") is None


def test_cached_id_and_revision_resolve_to_the_snapshot(source: Path, offline_cache: Path) -> None:
    snapshot = cache_layout(offline_cache, "org/tiny", source)
    found = check_model_dir("org/tiny")
    assert found.path == snapshot and len(found.weight_files) > 1
    assert check_model_dir(f"org/tiny@{COMMIT}").path == snapshot


def test_local_path_wins_over_the_cache(source: Path, offline_cache: Path, tmp_path: Path, monkeypatch) -> None:
    cache_layout(offline_cache, "org/tiny", source)
    monkeypatch.chdir(tmp_path)
    shutil.copytree(source, tmp_path / "org" / "tiny")
    assert check_model_dir("org/tiny").path == Path("org/tiny")


def test_offline_and_not_cached_is_a_clear_error(offline_cache: Path) -> None:
    with pytest.raises(HubModelError, match="not in the local Hugging Face cache.*HF_HUB_OFFLINE"):
        check_model_dir("org/missing")


def test_incomplete_snapshot_is_not_used_offline(source: Path, offline_cache: Path) -> None:
    snapshot = cache_layout(offline_cache, "org/partial", source)
    next(snapshot.glob("model-*.safetensors")).unlink()  # an interrupted download
    with pytest.raises(HubModelError, match="not in the local Hugging Face cache"):
        check_model_dir("org/partial")


def test_remote_code_is_refused_unless_opted_in(source: Path, tmp_path: Path) -> None:
    model = shutil.copytree(source, tmp_path / "remote")
    config = json.loads((model / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_x.XForCausalLM"}
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelDirError, match="config.json.*auto_map.*--trust-remote-code"):
        check_model_dir(model)
    assert check_model_dir(model, trust_remote_code=True).trust_remote_code


def _fake_hub(monkeypatch, remote: Path, calls: list) -> None:
    """snapshot_download that 'downloads' from ``remote`` only the files its patterns allow."""
    import fnmatch

    import huggingface_hub
    import huggingface_hub.constants as constants

    real = huggingface_hub.snapshot_download

    def fake(repo_id, revision=None, allow_patterns=None, local_files_only=False, **kw):
        if local_files_only:
            return real(repo_id, revision=revision, local_files_only=True)
        calls.append(list(allow_patterns))
        repo = Path(constants.HF_HUB_CACHE) / f"models--{repo_id.replace('/', '--')}"
        snapshot = repo / "snapshots" / COMMIT
        snapshot.mkdir(parents=True, exist_ok=True)
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / "main").write_text(COMMIT)
        for f in remote.iterdir():
            if any(fnmatch.fnmatch(f.name, p) for p in allow_patterns):
                shutil.copy(f, snapshot / f.name)
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)


def test_download_fetches_only_config_tokenizer_and_safetensors(source: Path, offline_cache: Path,
                                                                 tmp_path: Path, monkeypatch) -> None:
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    remote = shutil.copytree(source, tmp_path / "remote")
    (remote / "pytorch_model.bin").write_bytes(b"old format")
    (remote / "model.gguf").write_bytes(b"other format")
    calls: list = []
    _fake_hub(monkeypatch, remote, calls)
    found = check_model_dir("org/remote")
    names = {p.name for p in found.path.iterdir()}
    assert "pytorch_model.bin" not in names and "model.gguf" not in names
    assert {"config.json", "tokenizer.json", "model.safetensors.index.json"} <= names
    assert found.weight_files and all(f.is_file() for f in found.weight_files)
    assert len(calls) == 2  # metadata first, then exactly the weight files the index names
    assert calls[1] == sorted(f.name for f in source.glob("*.safetensors"))


def test_dataset_id_online_fetches_data_files_only_and_a_typo_says_local_and_hub(offline_cache: Path, tmp_path: Path,
                                                                                   monkeypatch) -> None:
    import fnmatch

    import huggingface_hub
    import huggingface_hub.constants as constants
    from huggingface_hub.errors import RepositoryNotFoundError

    from shardtune.model.hub import HubDatasetError, resolve_dataset

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    remote = tmp_path / "remote"
    (remote / "data").mkdir(parents=True)
    write_jsonl(remote / "data" / "train.jsonl", instruction_records(2))
    (remote / "README.md").write_text("---\nlicense: mit\n---\n")
    (remote / "loader.py").write_text("")  # a dataset script: never fetched
    real = huggingface_hub.snapshot_download

    def fake(repo_id, repo_type=None, revision=None, allow_patterns=None, local_files_only=False, **kw):
        if local_files_only:
            return real(repo_id, repo_type=repo_type, revision=revision, local_files_only=True)
        if repo_id != "org/remote":
            refusal = RepositoryNotFoundError.__new__(RepositoryNotFoundError)
            Exception.__init__(refusal, "404 Client Error")
            raise refusal
        snapshot = cache_layout(offline_cache, repo_id, tmp_path / "empty", kind="datasets")
        for f in remote.rglob("*"):
            name = f.relative_to(remote).as_posix()
            if f.is_file() and any(fnmatch.fnmatch(name, pattern) for pattern in allow_patterns):
                (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(f, snapshot / name)
        return str(snapshot)

    (tmp_path / "empty").mkdir()
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    found = resolve_dataset("org/remote")
    assert found is not None and {f.relative_to(found).as_posix() for f in found.rglob("*") if f.is_file()} \
        == {"README.md", "data/train.jsonl"}
    assert resolve_dataset("org/remote") == found  # now from the cache
    with pytest.raises(HubDatasetError, match="no local file or directory org/remtoe .*, and no Hub dataset "
                                              "repository has that name"):
        resolve_dataset("org/remtoe")


def test_plan_on_an_id_reads_headers_not_weights(source: Path, offline_cache: Path, tmp_path: Path,
                                                 monkeypatch) -> None:
    import huggingface_hub
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    calls: list = []
    _fake_hub(monkeypatch, shutil.copytree(source, tmp_path / "remote"), calls)
    headers = {f.name: read_header(f) for f in source.glob("*.safetensors")}

    def metadata(repo_id, revision=None):
        files = {name: SimpleNamespace(tensors={k: SimpleNamespace(**v) for k, v in h.items()})
                 for name, h in headers.items()}
        return SimpleNamespace(files_metadata=files)

    monkeypatch.setattr(huggingface_hub, "get_safetensors_metadata", metadata)
    found = check_model_dir("org/remote", weights=False)
    assert not list(found.path.glob("*.safetensors")) and len(calls) == 1
    assert checkpoint_bytes(found) == checkpoint_bytes(check_model_dir(source))


def test_cli_finetune_plan_eval_on_a_cached_id_offline(source: Path, tmp_path: Path) -> None:
    """The real environment variables, in fresh processes, as a user sets them."""
    cache_layout(tmp_path / "hf" / "hub", "org/tiny", source)
    data = write_jsonl(tmp_path / "train.jsonl", instruction_records(8))
    (tmp_path / "card" / "data").mkdir(parents=True)
    write_jsonl(tmp_path / "card" / "data" / "train.jsonl", instruction_records(8))  # a Hub dataset's files
    cache_layout(tmp_path / "hf" / "hub", "org/records", tmp_path / "card", kind="datasets")
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HUB_CACHE", None)

    def shardtune(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(cli_process.command(list(args), env), env=env, capture_output=True, text=True,
                              timeout=300)

    plan = shardtune("plan", "--model", "org/tiny", "--batch-size", "2", "--seq-len", "32", "--json")
    assert plan.returncode == 0, plan.stderr
    run = shardtune("finetune", "--model", "org/tiny", "--data", "org/records", "--out", str(tmp_path / "out"),
                    "--steps", "1", "--batch-size", "2", "--seq-len", "128", "--dtype", "fp32")
    assert run.returncode == 0, run.stderr
    assert "tokenizing records: 8/8 records" in run.stderr  # the dataset id, read from the cache
    adapter_config = json.loads((tmp_path / "out" / "adapter" / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == "org/tiny"
    ev = shardtune("eval", "--model", "org/tiny", "--adapter", str(tmp_path / "out" / "adapter"),
                   "--data", str(data), "--max-new-tokens", "0", "--json")
    assert ev.returncode == 0, ev.stderr
    missing = shardtune("finetune", "--model", "org/absent", "--data", str(data), "--out", str(tmp_path / "o2"))
    assert missing.returncode == 2 and "not in the local Hugging Face cache" in missing.stderr
    assert "Traceback" not in missing.stderr
    typo = shardtune("finetune", "--model", "org/tiny", "--data", "org/recrods", "--out", str(tmp_path / "o3"))
    assert typo.returncode == 2 and "Traceback" not in typo.stderr, typo.stderr
    message = typo.stderr.strip().splitlines()[-1]  # one message, before any worker started
    assert message.count("org/recrods") >= 2 and "option 'data'" in message, message
    assert "no local file or directory org/recrods" in message and "not in the local Hugging Face cache" in message
    assert "HF_HUB_OFFLINE" in message and not (tmp_path / "o3").exists()
