"""What a new user sees: progress on every long step, one clean log, messages that name the real cause.

Each test runs the command a user types and reads its captured output (docs/output-and-logs.md).
"""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest

import cli_process
from tiny import instruction_records, make_model, write_jsonl

REPO = Path(__file__).resolve().parents[1]
NOISE = ("Enum subclass", "Failed to load", "IProgress not found", "Loading weights", "Writing model shards",
         "UserWarning", "FutureWarning", "DeprecationWarning")
LOG_PREFIX = re.compile(r"^\d\d:\d\d:\d\d \[rank \d+\] [A-Z]+ ")


def shardtune(*args: str, cwd: Path | None = None, env: dict | None = None,
              fresh: bool = False) -> subprocess.CompletedProcess:
    """The command run as typed; forked from a starter that imported the libraries already (tests/cli_process.py)
    unless ``fresh``: what the libraries print when they are imported shows in a fresh process only."""
    environ = {k: v for k, v in os.environ.items() if k != "SHARDTUNE_VERBOSE"}
    environ["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])
    environ.update(env or {})
    argv = [sys.executable, "-m", "shardtune", *args] if fresh else cli_process.command(list(args), environ)
    return subprocess.run(argv, capture_output=True, text=True, cwd=cwd,
                          env=environ, timeout=600)


def lines(text: str) -> list[str]:
    """Finished lines: a progress bar's redraws (carriage returns) count as the last frame only."""
    return [ln.rsplit("\r", 1)[-1].strip() for ln in text.split("\n") if ln.rsplit("\r", 1)[-1].strip()]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path) -> tuple[Path, subprocess.CompletedProcess]:
    """A 2-rank fine-tune with validation whose records are cut by --seq-len (a warning every rank reaches), with
    activation checkpointing (which transformers 5.25 renamed, warning under the old name)."""
    root = tmp_path_factory.mktemp("newcomer")
    data = write_jsonl(root / "train.jsonl", instruction_records(16))
    result = shardtune("finetune", "--model", str(tiny_llama), "--data", str(data), "--val-data", str(data),
                       "--out", str(root / "out"), "--steps", "3", "--batch-size", "4", "--nproc", "2",
                       "--seq-len", "60", "--dtype", "fp32", "--activation-checkpointing",
                       env={"SHARDTUNE_CACHE": str(root / "cache")})
    assert result.returncode == 0, result.stderr
    return root, result


def test_finetune_prints_each_fact_once_without_library_noise(run) -> None:
    root, result = run
    text = result.stdout + result.stderr
    for noise in NOISE:
        assert noise not in text, noise
    log = lines(text)
    assert len(log) == len(set(log)), [ln for ln in log if log.count(ln) > 1]
    said = [LOG_PREFIX.sub("", ln) for ln in log]
    # the automatic choice, said once by rank 0, not again where the model is sharded
    assert sum("fastest setting that fits" in ln for ln in said) == 1, said
    assert any(ln.startswith("configuration: fastest setting that fits") for ln in said), said
    cut = [ln for ln in log if "were cut to --seq-len" in ln]
    assert len(cut) == 1 and "[rank 1]" not in cut[0]  # every rank reaches it; rank 0 says it
    assert any(ln.startswith("tokenizing train.jsonl: 16/16 records in") for ln in log)
    assert "MiB]" in result.stderr and "| peak " in result.stderr  # the bar's memory: peak so far, binary units
    assert "step 3: val_loss" in result.stdout and result.stdout.count("val_loss") == 2  # the line and the table


def test_load_says_once_how_much_rank_0_read_and_the_choice_is_in_binary_units(run) -> None:
    _, result = run
    log = lines(result.stderr)
    # counted in the raw output: another rank's line may land inside a bar's redraws
    assert result.stderr.count(" of weights in ") == 1, result.stderr
    loaded = [ln for ln in log if ln.startswith("loaded ") and " of weights in " in ln]
    assert len(loaded) == 1 and "KiB of weights" in loaded[0] and "rank 0's part" in loaded[0], loaded
    choice = [ln for ln in log if "configuration: fastest setting that fits" in ln]
    assert len(choice) == 1 and "iB per rank" in choice[0] and " MB" not in choice[0], choice


def test_adapter_weights_are_written_0644_like_the_other_files(run) -> None:
    root, _ = run
    modes = {f.name: stat.S_IMODE(f.stat().st_mode) for f in (root / "out" / "adapter").iterdir()}
    assert modes["adapter_model.safetensors"] == modes["adapter_config.json"] == 0o666 & ~_umask()


def _umask() -> int:
    current = os.umask(0)
    os.umask(current)
    return current


def test_eval_shows_progress_with_token_rate_and_a_summary(run, tiny_llama: Path) -> None:
    root, _ = run
    result = shardtune("eval", "--model", str(tiny_llama), "--adapter", str(root / "out" / "adapter"),
                       "--data", str(root / "train.jsonl"), "--max-new-tokens", "4")
    assert result.returncode == 0, result.stderr
    log = lines(result.stderr)
    assert any(ln.startswith("eval loss: 16/16 records in") and "tok/s" in ln for ln in log), log
    assert any(ln.startswith("eval answers: 16/16 answers in") for ln in log), log
    assert any(ln.startswith("loading model: 1/1 model in") for ln in log), log
    assert not any(noise in result.stderr for noise in NOISE)


def test_merge_counts_tensors_says_mib_and_what_dtype_it_writes(run, tiny_llama: Path, tmp_path: Path) -> None:
    root, _ = run
    result = shardtune("merge", "--model", str(tiny_llama), "--adapter", str(root / "out" / "adapter"),
                       "--out", str(tmp_path / "merged"), "--dtype", "bf16")
    assert result.returncode == 0, result.stderr
    assert " MiB)" in result.stdout and " MB)" not in result.stdout
    assert "bfloat16" in result.stdout and "`--dtype fp32`" in result.stdout
    assert any(ln.startswith("merge: ") and "tensors in" in ln for ln in lines(result.stderr))
    assert not any(noise in result.stdout + result.stderr for noise in NOISE)


def test_verbose_keeps_the_library_warnings(run, tiny_llama: Path, tmp_path: Path) -> None:
    root, _ = run
    args = ("merge", "--model", str(tiny_llama), "--adapter", str(root / "out" / "adapter"))
    quiet = shardtune(*args, "--out", str(tmp_path / "a"), fresh=True)
    loud = shardtune(*args, "--out", str(tmp_path / "b"), "--verbose", fresh=True)
    assert quiet.returncode == loud.returncode == 0
    assert not any(n in quiet.stderr for n in NOISE)
    assert any(n in loud.stderr for n in NOISE[:2])  # torchao's and torch's import-time lines


def test_missing_local_looking_path_is_named_before_any_hub_look_up(train_jsonl: Path, tmp_path: Path) -> None:
    for model in ("./modles/smollm2-135m", "models/nested/smollm2-135m", "~/no-such-model-dir"):
        result = shardtune("eval", "--model", model, "--data", str(train_jsonl), cwd=tmp_path,
                           env={"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9"})
        assert result.returncode == 2, result.stderr
        assert "does not exist" in result.stderr and "no Hub look-up" in result.stderr, result.stderr
        assert "Traceback" not in result.stderr


def test_hub_like_id_not_found_says_local_and_hub_both(train_jsonl: Path, tmp_path: Path) -> None:
    result = shardtune("eval", "--model", "modles/smollm2-135m", "--data", str(train_jsonl), cwd=tmp_path,
                       env={"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")})
    assert result.returncode == 2
    assert "no local directory modles/smollm2-135m" in result.stderr and "Hugging Face cache" in result.stderr


def test_nan_in_a_base_weight_is_named_at_load_once(tmp_path: Path, train_jsonl: Path) -> None:
    """Every rank finds it; the launcher says it once, naming a rank, and none of torch's launcher lines."""
    from safetensors.torch import load_file, save_file

    model = make_model(tmp_path / "model", "llama")
    weights = load_file(str(model / "model.safetensors"))
    name = next(k for k in weights if k.endswith("mlp.up_proj.weight"))
    weights[name][0, 0] = float("nan")
    save_file(weights, str(model / "model.safetensors"), metadata={"format": "pt"})
    result = shardtune("finetune", "--model", str(model), "--data", str(train_jsonl), "--out", str(tmp_path / "o"),
                       "--steps", "1", "--batch-size", "4", "--nproc", "2", "--dtype", "fp32")
    assert result.returncode == 2
    assert result.stderr.count(f"base weight {name} holds NaN") == 1, result.stderr
    assert lines(result.stderr)[-1].startswith("error: rank ")
    assert "exitcode" not in result.stderr and "elastic" not in result.stderr, result.stderr
    assert "--lr" not in result.stderr and "diverged" not in result.stderr


def test_zero_gradients_with_lora_alpha_0_blame_lora_alpha_not_lr(tmp_path: Path, caplog) -> None:
    from shardtune.train.guard import ZERO_GRAD_STEPS, TrainingGuard

    guard = TrainingGuard(tmp_path, 2e-4, True, lora_alpha=0.0)
    with caplog.at_level("WARNING", logger="shardtune"):
        logger = __import__("logging").getLogger("shardtune")
        logger.propagate, before = True, logger.propagate
        try:
            for step in range(1, ZERO_GRAD_STEPS + 1):
                guard.check(step, 1.0, 0.0)
        finally:
            logger.propagate = before
    assert "--lora-alpha 0" in caplog.text and "--lr" not in caplog.text


def test_broken_chat_template_names_the_template_and_the_record(tmp_path: Path, no_workers) -> None:
    from shardtune import finetune
    from shardtune.train.data.records import DataError

    model = make_model(tmp_path / "model", "llama")
    template = model / "chat_template.jinja"
    config = model / "tokenizer_config.json"
    broken = "{% for m in messages %}{{ m['content'] | no_such_filter }}{% endfor %}"
    if template.is_file():
        template.write_text(broken)
        where = template
    else:
        cfg = json.loads(config.read_text())
        cfg["chat_template"] = broken
        config.write_text(json.dumps(cfg))
        where = config
    data = write_jsonl(tmp_path / "train.jsonl", instruction_records(4))
    with pytest.raises(DataError) as err:
        finetune({"model": str(model), "data": str(data), "out": str(tmp_path / "o"), "steps": 1, "batch-size": 4})
    message = str(err.value)
    assert str(where) in message and f"{data}:1" in message and "the template is at fault" in message


def test_adapter_for_another_base_names_the_tensor_and_both_shapes(run, tmp_path: Path) -> None:
    root, _ = run
    import shutil

    from safetensors.torch import load_file, save_file

    wider = make_model(tmp_path / "wider", "llama", tied=True, hidden=64)
    result = shardtune("eval", "--model", str(wider), "--adapter", str(root / "out" / "adapter"),
                       "--data", str(root / "train.jsonl"), "--max-new-tokens", "0")
    assert result.returncode == 2, result.stderr  # the adapter records its base: the config keys that differ
    assert "was trained on another base model" in result.stderr and "hidden_size was 32, now 64" in result.stderr
    peft_own = shutil.copytree(root / "out" / "adapter", tmp_path / "peft-adapter")  # records none: the tensors
    save_file(load_file(peft_own / "adapter_model.safetensors"), peft_own / "adapter_model.safetensors")
    result = shardtune("eval", "--model", str(wider), "--adapter", str(peft_own), "--data", str(root / "train.jsonl"),
                       "--max-new-tokens", "0")
    assert result.returncode == 2, result.stderr
    message = result.stderr.strip().splitlines()[-1]
    assert "size mismatch for" in message and "lora_" in message and message.count("(") >= 2, message
    assert not message.endswith("PeftModelForCausalLM:")


def test_tokenizer_json_of_wrong_structure_names_file_and_key(tmp_path: Path, train_jsonl: Path) -> None:
    model = make_model(tmp_path / "model", "llama")
    (model / "tokenizer.json").write_text(json.dumps({"version": "1.0", "model": {"type": "BPE"}}))
    result = shardtune("eval", "--model", str(model), "--data", str(train_jsonl))
    assert result.returncode == 2
    assert f"{model / 'tokenizer.json'}" in result.stderr and "'added_tokens'" in result.stderr


def test_report_rounds_figures(tmp_path: Path) -> None:
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 3.0 / s, "tokens_per_second": 49.0963})
                                               + "\n" for s in range(1, 6)))
    (out / "summary.json").write_text(json.dumps({"strategy": "ddp", "world_size": 1, "load_seconds": 7.91,
                                                  "tokens_per_second": 49.0963, "train_peak_mb": [929.4]}))
    pytest.importorskip("matplotlib")
    result = shardtune("report", str(out))
    assert result.returncode == 0, result.stderr
    md = (out / "report.md").read_text()
    assert "| 7.91 |" in md and "| 49.1 |" in md and "| train peak MiB per rank | 929.4 |" in md


def test_loss_plot_is_log_scale(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    from shardtune.tools import report

    seen = []
    monkeypatch.setattr(Figure, "savefig", lambda fig, path, **kw: seen.append(fig.axes[0].get_yscale()))
    report.plot_loss([{"step": 1, "loss": 4.0}, {"step": 2, "loss": 0.01, "val_loss": 0.02}], tmp_path / "l.png")
    assert seen == ["log"]


def test_notebook_paths_resolve_from_examples_folder() -> None:
    nb = json.loads((REPO / "examples" / "finetune_notebook.ipynb").read_text())
    params, run_cell = "".join(nb["cells"][1]["source"]), "".join(nb["cells"][2]["source"])
    prefix = run_cell[:run_cell.index("summary =")].replace("import shardtune\n", "")
    here = os.getcwd()
    scope: dict = {}
    try:
        os.chdir(REPO / "examples")  # where Jupyter starts a kernel for this notebook
        exec(params + "\n" + prefix, scope)  # noqa: S102 - the notebook's own cells
    finally:
        os.chdir(here)
    assert scope["MODEL"] == str(REPO / "models" / "smollm2-135m")
    assert Path(scope["DATA"]).is_file()


def test_zarnovia_comment_gives_the_steps_the_run_does() -> None:
    from shardtune.config import build_config
    from shardtune.train.schedule import total_steps

    cfg = build_config(str(REPO / "examples" / "zarnovia.yaml"))
    records = sum(1 for ln in (REPO / "examples" / "zarnovia_train.jsonl").read_text().splitlines() if ln.strip())
    steps = total_steps(cfg, records)
    assert steps == 38
    assert f"= {steps}\n# optimizer steps" in (REPO / "examples" / "zarnovia.yaml").read_text()
