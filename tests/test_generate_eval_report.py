"""generate (greedy = a hand-written greedy loop), eval (loss = a hand-written sum, N ranks = 1 rank), report."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch

from shardtune.cli import main as cli_main
from shardtune.tools.evaluate import contains_match, evaluate, exact_match, normalize
from shardtune.tools.generate import generate_answers, load_model, prompt_ids, read_prompts, stop_ids
from shardtune.tools.report import ReportError, write_report
from shardtune.train.data.records import IGNORE
from shardtune.train.data.sft import tokenize

from tiny import instruction_records, make_model, write_jsonl

PROMPTS = ["Repeat: red cat", "What is the sun?", "x", [{"role": "system", "content": "Be brief."},
                                                       {"role": "user", "content": "Name a bird."}]]


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("gen")
    make_model(root / "model", "llama")
    # An adapter with random (not zero) B matrices, so that it visibly changes the model.
    torch.manual_seed(3)
    base = AutoModelForCausalLM.from_pretrained(root / "model")
    peft_model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                                                 init_lora_weights=False))
    peft_model.save_pretrained(root / "adapter")
    records = instruction_records(7) + [
        {"text": "the sea and the moon"},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "blue bird"}]},
    ]
    write_jsonl(root / "data.jsonl", records)
    return root


def greedy_by_hand(model, tokenizer, prompt, max_new_tokens: int) -> str:
    ids = prompt_ids(tokenizer, prompt)
    stops, new = stop_ids(model, tokenizer), []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            token = int(model(input_ids=torch.tensor([ids + new])).logits[0, -1].argmax())
            if token in stops:
                break
            new.append(token)
    return tokenizer.decode(new, skip_special_tokens=True).strip()


def test_prompt_is_rendered_as_training_renders_it(root):
    _, tokenizer = load_model(root / "model")
    example, _ = tokenize(tokenizer, {"instruction": "Repeat: red cat", "output": "cat red"}, 512)
    prompt_len = next(i for i, x in enumerate(example.labels) if x != IGNORE)
    assert prompt_ids(tokenizer, "Repeat: red cat") == example.input_ids[:prompt_len]


def test_greedy_is_deterministic_equals_a_manual_loop_and_ignores_batching(root):
    model, tokenizer = load_model(root / "model")
    batched = generate_answers(model, tokenizer, PROMPTS, max_new_tokens=12, batch_size=4)
    assert batched == generate_answers(model, tokenizer, PROMPTS, max_new_tokens=12, batch_size=1)
    assert batched == [greedy_by_hand(model, tokenizer, p, 12) for p in PROMPTS]
    assert any(batched)


def test_sampling_follows_the_seed(root):
    model, tokenizer = load_model(root / "model")
    kwargs = dict(max_new_tokens=12, temperature=1.0, top_p=0.9)
    first = generate_answers(model, tokenizer, PROMPTS, seed=5, **kwargs)
    assert first == generate_answers(model, tokenizer, PROMPTS, seed=5, **kwargs)
    assert first != generate_answers(model, tokenizer, PROMPTS, seed=6, **kwargs)


def test_adapter_changes_logits_and_answers(root):
    base, tokenizer = load_model(root / "model")
    tuned, _ = load_model(root / "model", root / "adapter")
    ids = torch.tensor([prompt_ids(tokenizer, PROMPTS[0])])
    with torch.no_grad():
        assert (tuned(input_ids=ids).logits - base(input_ids=ids).logits).abs().max() > 1e-2
    assert generate_answers(base, tokenizer, PROMPTS, 12) != generate_answers(tuned, tokenizer, PROMPTS, 12)


def test_generate_cli_streams_the_greedy_answer(root, capsys):
    model, tokenizer = load_model(root / "model")
    expected = greedy_by_hand(model, tokenizer, "hello", 10)
    assert cli_main(["generate", "--model", str(root / "model"), "--prompt", "hello", "--max-new-tokens", "10"]) == 0
    assert capsys.readouterr().out.strip() == expected


def test_prompt_files_text_and_jsonl(tmp_path):
    (tmp_path / "p.txt").write_text("first\n\n  second \n")
    assert read_prompts(tmp_path / "p.txt") == ["first", "second"]
    write_jsonl(tmp_path / "p.jsonl", [
        {"instruction": "Sum", "input": "1 2"},
        {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]},
    ])
    assert read_prompts(tmp_path / "p.jsonl") == [[{"role": "user", "content": "Sum\n\n1 2"}],
                                                  [{"role": "user", "content": "a"}]]
    (tmp_path / "p.json").write_text(json.dumps([{"text": "once upon"}]))
    assert read_prompts(tmp_path / "p.json") == [[{"role": "user", "content": "once upon"}]]
    (tmp_path / "bad.jsonl").write_text('{"instruction": "ok"}\n{"question": 1}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2"):
        read_prompts(tmp_path / "bad.jsonl")


def manual_loss(root: Path, adapter: Path | None) -> float:
    """Mean next-token cross-entropy over target tokens, record by record, written out by hand (fp32:
    under --dtype auto a CPU with AVX512 computes in bf16, where batching alone moves the loss by ~1e-4)."""
    model, tokenizer = load_model(root / "model", adapter, "fp32")
    total, count = 0.0, 0
    for line in (root / "data.jsonl").read_text().splitlines():
        example, _ = tokenize(tokenizer, json.loads(line), 512)
        with torch.no_grad():
            logp = model(input_ids=torch.tensor([example.input_ids])).logits[0].log_softmax(-1)
        for t in range(1, len(example.labels)):
            if example.labels[t] != IGNORE:
                total -= logp[t - 1, example.labels[t]].item()
                count += 1
    return total / count


def test_eval_json_loss_is_the_mean_over_target_tokens(root, capsys):
    args = ["eval", "--model", str(root / "model"), "--adapter", str(root / "adapter"), "--data",
            str(root / "data.jsonl"), "--json", "--batch-size", "3", "--max-new-tokens", "6", "--dtype", "fp32"]
    assert cli_main(args) == 0
    result = json.loads(capsys.readouterr().out)
    assert {"loss", "perplexity", "records", "exact_match", "contains_match"} <= set(result)
    assert "answers" not in result
    assert result["records"] == 9 and result["questions"] == 8  # the text record has no expected answer
    assert 0 <= result["exact_match"] <= result["contains_match"] <= 1
    assert result["loss"] == pytest.approx(manual_loss(root, root / "adapter"), rel=1e-5)
    assert result["perplexity"] == pytest.approx(math.exp(result["loss"]), rel=1e-9)


def test_eval_maps_columns_with_data_fields(root, tmp_path, capsys):
    """Other column names, mapped with --data-fields: the same loss and questions as the usual fields."""
    records = instruction_records(5)
    write_jsonl(tmp_path / "usual.jsonl", records)
    write_jsonl(tmp_path / "other.jsonl", [{"question": r["instruction"], "answer": r["output"]} for r in records])
    common = ["eval", "--model", str(root / "model"), "--json", "--max-new-tokens", "4"]
    assert cli_main([*common, "--data", str(tmp_path / "usual.jsonl")]) == 0
    usual = json.loads(capsys.readouterr().out)
    assert cli_main([*common, "--data", str(tmp_path / "other.jsonl"), "--data-fields",
                     "prompt=question,response=answer"]) == 0
    mapped = json.loads(capsys.readouterr().out)
    assert mapped["questions"] == usual["questions"] == 5
    assert mapped["loss"] == pytest.approx(usual["loss"], rel=1e-6)
    assert mapped["exact_match"] == usual["exact_match"]
    assert cli_main([*common, "--data", str(tmp_path / "other.jsonl")]) == 2  # unmapped: a clear data error
    assert "other.jsonl" in capsys.readouterr().err


def test_tools_run_a_models_own_code_only_when_trusted(root, tmp_path, capsys):
    """generate, eval and merge refuse a model that names its own code, and run it with --trust-remote-code."""
    import shutil

    model = shutil.copytree(root / "model", tmp_path / "remote")
    (model / "modeling_x.py").write_text(
        "from transformers import LlamaForCausalLM\n\n\nclass XForCausalLM(LlamaForCausalLM):\n    pass\n")
    config = json.loads((model / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_x.XForCausalLM"}
    (model / "config.json").write_text(json.dumps(config))
    generate = ["generate", "--model", str(model), "--prompt", "hi", "--max-new-tokens", "2"]
    evaluate = ["eval", "--model", str(model), "--data", str(root / "data.jsonl"), "--max-new-tokens", "0"]
    merge = ["merge", "--model", str(model), "--adapter", str(root / "adapter"), "--out", str(tmp_path / "m")]
    for argv in (generate, evaluate, merge):
        assert cli_main(argv) == 2
        assert "auto_map" in capsys.readouterr().err and not (tmp_path / "m").exists()
    for argv in (generate, evaluate, merge):
        assert cli_main([*argv, "--trust-remote-code"]) == 0
    loaded, _ = load_model(model, trust_remote_code=True)
    assert type(loaded).__name__ == "XForCausalLM"
    assert (tmp_path / "m" / "config.json").is_file()


def test_eval_on_two_processes_equals_one(root):
    kwargs = dict(adapter=root / "adapter", max_new_tokens=6, answers=True, batch_size=2)
    one = evaluate(root / "model", root / "data.jsonl", nproc=1, **kwargs)
    two = evaluate(root / "model", root / "data.jsonl", nproc=2, **kwargs)
    assert two["world_size"] == 2 and two["target_tokens"] == one["target_tokens"]
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-5)
    assert [a["answer"] for a in two["answers"]] == [a["answer"] for a in one["answers"]]
    assert two["exact_match"] == one["exact_match"]


def test_matching_rules():
    assert normalize("  The  Capital is PARIS.!  ") == "the capital is paris"
    assert exact_match("Paris.", "paris") and exact_match(" PARIS ", "Paris!")
    assert not exact_match("It is Paris.", "Paris")
    assert contains_match("It is Paris, of course.", "paris.")
    assert contains_match("Velmora", "Velmora") and contains_match("the river Osk flows", "River Osk")
    assert not contains_match("1492 or so", "149")  # whole words only
    assert not contains_match("Parisian", "Paris")
    assert not contains_match("anything", "") and contains_match("", " . ")


def test_eval_scores_answers(root, tmp_path):
    """Records whose expected output is (a reworded copy of) the model's own answer match; others don't."""
    model, tokenizer = load_model(root / "model")
    answer = generate_answers(model, tokenizer, ["Repeat: red cat"], max_new_tokens=8)[0]
    assert answer
    write_jsonl(tmp_path / "qa.jsonl", [
        {"instruction": "Repeat: red cat", "output": answer.upper() + "."},  # exact after normalising
        {"instruction": "Repeat: red cat", "output": "zzz not it"},
    ])
    result = evaluate(root / "model", tmp_path / "qa.jsonl", max_new_tokens=8, answers=True)
    assert (result["exact_match"], result["contains_match"]) == (0.5, 0.5)
    assert [a["exact"] for a in result["answers"]] == [True, False]
    loss_only = evaluate(root / "model", tmp_path / "qa.jsonl", max_new_tokens=0)
    assert loss_only["exact_match"] is None and loss_only["loss"] == pytest.approx(result["loss"])


def _fake_run(out: Path) -> None:
    out.mkdir(parents=True)
    steps = [{"step": s, "loss": 3.0 / s, "tokens_per_second": 100.0 + s, "memory_mb": 50.0} for s in range(1, 7)]
    steps[2]["val_loss"], steps[5]["val_loss"] = 2.0, 1.5
    steps[3]["loss"] = None  # how metrics.jsonl writes a NaN loss
    (out / "metrics.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    (out / "summary.json").write_text(json.dumps({
        "strategy": "fsdp2", "strategy_reason": "2 ranks", "world_size": 2, "steps": 6, "val_loss": 1.5,
        "load_peak_mb": [400.0, 390.5], "train_peak_mb": [600.0, 610.0], "save_peak_mb": [450.0, 440.0],
        "tokens_per_second": 103.2, "adapter": str(out / "adapter")}))


def test_report_writes_plots_and_markdown(tmp_path, capsys):
    _fake_run(tmp_path / "run")
    assert cli_main(["report", str(tmp_path / "run")]) == 0
    for name in ("loss.png", "throughput.png", "memory.png"):
        assert (tmp_path / "run" / name).read_bytes()[:4] == b"\x89PNG"
    md = (tmp_path / "run" / "report.md").read_text()
    assert "](loss.png)" in md and "](throughput.png)" in md and "](memory.png)" in md
    assert "| strategy | fsdp2 (2 ranks) |" in md and "| train peak MiB per rank | 600, 610 |" in md
    assert "report.md" in capsys.readouterr().out


def test_eval_results_go_to_the_run_folder_trackers_and_report(root, tmp_path, capsys):
    """--data results: OUT/eval.json (--out), the run's TensorBoard at its last step, a table in report.md."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _fake_run(tmp_path / "run")
    args = ["eval", "--model", str(root / "model"), "--adapter", str(root / "adapter"), "--data",
            str(root / "data.jsonl"), "--max-new-tokens", "4", "--report-to", "tensorboard"]
    assert cli_main(args) == 2  # no run folder: neither a fine-tune's adapter nor --out
    assert "--report-to needs a run folder" in capsys.readouterr().err
    assert cli_main([*args, "--out", str(tmp_path / "run" / "eval.json")]) == 0
    saved = json.loads((tmp_path / "run" / "eval.json").read_text())
    acc = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    acc.Reload()
    [event] = acc.Scalars("eval/adapter/data/loss")
    assert event.step == 6 and event.value == pytest.approx(saved["loss"])
    assert cli_main(["report", str(tmp_path / "run")]) == 0
    md = (tmp_path / "run" / "report.md").read_text()
    assert "## Evaluation on" in md and f"| loss | {saved['loss']:.4g} |" in md


def test_report_without_summary_still_plots(tmp_path):
    _fake_run(tmp_path / "run")
    (tmp_path / "run" / "summary.json").unlink()
    written = write_report(tmp_path / "run")
    assert set(written) == {"loss", "throughput", "report"}
    assert "did not finish" in written["report"].read_text()


def test_report_fails_clearly_without_metrics(tmp_path, capsys):
    (tmp_path / "run").mkdir()
    with pytest.raises(ReportError, match=r"metrics.jsonl does not exist"):
        write_report(tmp_path / "run")
    (tmp_path / "run" / "metrics.jsonl").write_text("\n")
    with pytest.raises(ReportError, match=r"metrics.jsonl is empty"):
        write_report(tmp_path / "run")
    assert cli_main(["report", str(tmp_path / "nowhere")]) == 2
    assert "nowhere" in capsys.readouterr().err


@pytest.mark.parametrize(("name", "content", "message"), [
    ("metrics.jsonl", b'{"step": 1, "loss": 2.0}\nnot json\n', r"metrics.jsonl:2: not a metrics record"),
    ("metrics.jsonl", b'{"step": 1, "loss": 2.0}\n\xff\n', r"metrics.jsonl:2: not valid UTF-8"),
    ("summary.json", b"{\n  oops", r"summary.json:2: not valid JSON"),
    ("summary.json", b"\xfe{}", r"summary.json:1: not valid UTF-8"),
    ("summary.json", b"[1, 2]", r"summary.json: expected a JSON object"),
])
def test_report_names_the_damaged_file_and_line(tmp_path, capsys, name, content, message):
    _fake_run(tmp_path / "run")
    (tmp_path / "run" / name).write_bytes(content)
    assert cli_main(["report", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert re.search(message, err) and "Traceback" not in err


def test_tools_build_the_model_on_its_device_never_whole_in_host_memory(tmp_path, monkeypatch):
    """eval/generate read each weight straight onto the device (a 70B in bf16 must not pass through host
    RAM first); with --quantize nf4 the fine-tune's own loader quantizes weight by weight, giving exactly
    the values of quantizing the whole loaded model (what a QLoRA fine-tune trained on)."""
    import transformers

    from shardtune.model import quantize

    model_dir = make_model(tmp_path / "model", "llama", hidden=64, row_scales=True)
    ids = torch.arange(1, 30)[None]
    real = transformers.AutoModelForCausalLM.from_pretrained
    asked = []

    def from_pretrained(path, *args, **kwargs):
        asked.append(kwargs.get("device_map"))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", from_pretrained)
    plain, _ = load_model(model_dir, dtype="bf16", device=torch.device("cpu"))
    assert asked == [{"": torch.device("cpu")}]  # straight onto the device
    quantized, _ = load_model(model_dir, dtype="bf16", quantize="nf4", device=torch.device("cpu"))
    assert len(asked) == 1  # no whole model in bf16 first
    reference = real(model_dir, dtype=torch.bfloat16).eval()
    quantize.quantize_in_place(reference)
    with torch.no_grad():
        torch.testing.assert_close(quantized(input_ids=ids).logits, reference(input_ids=ids).logits, rtol=0, atol=0)
        whole = real(model_dir, dtype=torch.bfloat16).eval()
        torch.testing.assert_close(plain(input_ids=ids).logits, whole(input_ids=ids).logits, rtol=0, atol=0)
    assert quantized.config.use_cache and quantized.generation_config.eos_token_id == 257
