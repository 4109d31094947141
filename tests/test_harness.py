"""`shardtune eval --tasks`: lm-evaluation-harness on base and base + adapter, over a local custom task."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("lm_eval")

from shardtune.cli import main  # noqa: E402

from tiny import write_jsonl  # noqa: E402

WORDS = ["cat", "dog", "sun", "moon", "tree", "sea", "rock", "bird"]
TASK = """task: tiny_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Q: {{{{question}}}}\\nA:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
  - metric: acc
"""


def _records(n: int = 16) -> list[dict]:
    g = torch.Generator().manual_seed(3)
    out = []
    for i in range(n):
        picks = [WORDS[int(j)] for j in torch.randperm(len(WORDS), generator=g)[:3]]
        out.append({"question": f"which {i}?", "choices": picks, "label": int(torch.randint(0, 3, (1,), generator=g))})
    return out


def _expected_accuracy(model_dir: Path, adapter: Path | None, records: list[dict]) -> float:
    """The harness's rule, computed here: the choice of highest summed log-likelihood after "Q: …\\nA:" + " "."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if adapter is not None:
        model = PeftModel.from_pretrained(model, str(adapter)).eval()
    right = 0
    for r in records:
        context = f"Q: {r['question']}\nA:"
        ctx = tok(context, add_special_tokens=False)["input_ids"]
        scores = []
        for choice in r["choices"]:
            ids = tok(context + " " + choice, add_special_tokens=False)["input_ids"]
            with torch.no_grad():
                logp = model(torch.tensor([ids])).logits[0, :-1].log_softmax(-1)
            scores.append(sum(logp[i - 1, ids[i]].item() for i in range(len(ctx), len(ids))))
        right += int(max(range(len(scores)), key=scores.__getitem__) == r["label"])
    return right / len(records)


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_llama):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("harness")
    records = _records()
    data = write_jsonl(root / "tiny_choice.jsonl", records)
    tasks = root / "tasks"
    tasks.mkdir()
    (tasks / "tiny_choice.yaml").write_text(TASK.format(data=data))
    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_llama),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    model.save_pretrained(root / "run" / "adapter")
    (root / "run" / "config.yaml").write_text("quantize: none\n")
    return root, tiny_llama, root / "run" / "adapter", tasks, records


def test_custom_task_accuracy_base_and_adapter_side_by_side(setup, capsys):
    root, model, adapter, tasks, records = setup
    code = main(["eval", "--model", str(model), "--adapter", str(adapter), "--tasks", "tiny_choice",
                 "--include-path", str(tasks), "--dtype", "fp32", "--batch-size", "4"])
    out = capsys.readouterr().out
    assert code == 0, out
    report = json.loads((root / "run" / "lm_eval.json").read_text())  # the adapter's run folder
    base_acc = report["results"]["base"]["tiny_choice"]["acc,none"]
    tuned_acc = report["results"]["adapter"]["tiny_choice"]["acc,none"]
    assert base_acc == pytest.approx(_expected_accuracy(model, None, records))
    assert tuned_acc == pytest.approx(_expected_accuracy(model, adapter, records))
    assert "tiny_choice" in out and "delta" in out


def test_limit_and_num_fewshot_reach_the_harness(setup, tmp_path, capsys):
    root, model, adapter, tasks, records = setup
    out = tmp_path / "r.json"
    assert main(["eval", "--model", str(model), "--tasks", "tiny_choice", "--include-path", str(tasks),
                 "--limit", "4", "--num-fewshot", "1", "--dtype", "fp32", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["limit"] == 4 and report["num_fewshot"] == 1 and "adapter" not in report["results"]


@pytest.fixture
def indexed(monkeypatch) -> list[bool]:
    """Each lm-eval TaskManager built from now on: whether it indexed lm-eval's own tasks too (seconds)."""
    import lm_eval.tasks

    built: list[bool] = []
    real = lm_eval.tasks.TaskManager

    def counting(*args, **kwargs):
        built.append(kwargs.get("include_defaults", True))
        return real(*args, **kwargs)

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", counting)
    return built


def test_unknown_task_missing_data_and_broken_task_files_are_named(setup, tmp_path, capsys, indexed):
    root, model, adapter, tasks, records = setup
    assert main(["eval", "--model", str(model), "--tasks", "no_such_task", "--include-path", str(tasks)]) == 2
    assert "no_such_task is not a task lm-eval knows" in capsys.readouterr().err
    assert indexed == [False, True]
    # Causes in the user's own files are named without indexing lm-eval's own thousands of tasks.
    indexed.clear()
    missing = tmp_path / "tasks"
    missing.mkdir()
    (missing / "gone.yaml").write_text(TASK.replace("tiny_choice", "gone").format(data=tmp_path / "absent.jsonl"))
    assert main(["eval", "--model", str(model), "--tasks", "gone", "--include-path", str(missing)]) == 2
    err = capsys.readouterr().err  # the local file is named, not the network blamed
    assert f"gone.yaml: task gone's data_files {tmp_path / 'absent.jsonl'} does not exist" in err, err
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "mine.yaml").write_text("task: mine\ndataset_path: json\n  oops: [\n")
    assert main(["eval", "--model", str(model), "--tasks", "mine", "--include-path", str(broken)]) == 2
    err = capsys.readouterr().err  # lm-eval skipped the file: its parse error, not "unknown task", is the cause
    assert f"{broken / 'mine.yaml'}:3 is not valid YAML" in err, err
    assert indexed == [False, False]


def test_results_go_to_the_runs_tracker_and_report(setup, capsys):
    """--report-to: the fine-tune's TensorBoard gets each metric at its last step; report.md shows them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    root, model, adapter, tasks, records = setup
    run = root / "run"
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in (1, 2, 3)))
    (run / "summary.json").write_text(json.dumps({"steps": 3}))
    assert main(["eval", "--model", str(model), "--adapter", str(adapter), "--tasks", "tiny_choice",
                 "--include-path", str(tasks), "--dtype", "fp32", "--limit", "6", "--report-to", "tensorboard"]) == 0
    saved = json.loads((run / "lm_eval.json").read_text())["results"]
    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    for label in ("base", "adapter"):
        [event] = acc.Scalars(f"lm_eval/{label}/tiny_choice/acc")
        assert event.step == 3 and event.value == pytest.approx(saved[label]["tiny_choice"]["acc,none"])
    capsys.readouterr()
    assert main(["report", str(run)]) == 0
    md = (run / "report.md").read_text()
    base, tuned = saved["base"]["tiny_choice"]["acc,none"], saved["adapter"]["tiny_choice"]["acc,none"]
    assert f"| tiny_choice | acc | {base:.4f} | {tuned:.4f} | {tuned - base:+.4f} |" in md


def test_own_tasks_are_indexed_alone_and_one_built_on_lm_evals_own_with_them(setup, tmp_path, indexed):
    """lm-eval's thousands of task files take seconds to index: tasks all in --include-path are looked up
    there alone, and a group of the user's that names one of lm-eval's own tasks is looked up with them."""
    from shardtune.tools import harness

    root, model, adapter, tasks, records = setup
    _, found = harness._tasks(["tiny_choice"], str(tasks))
    assert any("tiny_choice" in str(key) for key in found) and indexed == [False]
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "tiny_choice.yaml").write_text((tasks / "tiny_choice.yaml").read_text())
    (mixed / "mix.yaml").write_text("group: mix\ntask:\n  - tiny_choice\n  - arc_easy\n")
    indexed.clear()
    try:
        harness._tasks(["mix"], str(mixed))
    except harness.HarnessError as err:  # arc_easy's data is not cached on a machine without network
        assert "could not be loaded" in str(err), err
    assert indexed == [False, True]


def test_a_broken_task_file_is_named_early_only_when_it_names_a_task_asked_for(tmp_path):
    """Before lm-eval's own tasks are indexed, a broken file of --include-path is the cause of a task not found
    there only when its text names that task; another may be a task of lm-eval's own, looked up after."""
    from shardtune.tools.harness import HarnessError, check_task_files

    (tmp_path / "mine.yaml").write_text("task: mine\ndataset_path: json\n  oops: [\n")
    check_task_files(tmp_path, ["arc_easy"], ["arc_easy"], own_only=True)  # not its cause: no error yet
    with pytest.raises(HarnessError, match=r"mine is not a task in --include-path .*mine.yaml:3 is not valid YAML"):
        check_task_files(tmp_path, ["mine"], ["mine"], own_only=True)
    with pytest.raises(HarnessError, match="arc_easy is not a task lm-eval knows, and .*mine.yaml:3"):
        check_task_files(tmp_path, ["arc_easy"], ["arc_easy"])  # unknown after the full index: any broken file
