"""Sub-commands that use a trained adapter or a finished run: generate, eval, report.

Kept apart from cli.py so that its fine-tune commands and these evolve without touching each other;
``add_commands`` hangs them on the main parser. Heavy imports happen inside the commands, so
``shardtune --help`` stays fast.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from shardtune.config import DataConfig

SEQ_LEN = DataConfig().seq_len


def _at_least(low: int):
    """argparse's ``type`` of a whole-number option of at least ``low``: anything else is refused (exit 2) naming
    the option, before a model is loaded, not taken as a slice bound or a range step deep inside."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value
    return parse


def _number_in(low: float, high: float, low_open: bool = False):
    """argparse's ``type`` of a finite number between ``low`` and ``high`` (``low`` itself excluded with
    ``low_open``)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(value) or not (low < value if low_open else low <= value) or not value <= high:
            bound = f"above {low:g}" if low_open else f"at least {low:g}"
            raise argparse.ArgumentTypeError(f"must be a finite number {bound}" + (
                f" and at most {high:g}" if high != float("inf") else "") + f", got {text}")
        return value
    return parse


def _model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="Hugging Face model directory or Hub id org/name[@revision] "
                   "(the base the adapter was trained on)")
    p.add_argument("--adapter", help="LoRA adapter directory in peft format, e.g. OUT_DIR/adapter of a fine-tune "
                                     "[default: none, the base model alone]")
    p.add_argument("--dtype", default="auto", choices=("auto", "bf16", "fp16", "fp32"),
                   help="weights and compute dtype; auto: bf16 where the device computes in it natively "
                        "(Ampere+ GPUs, AVX512/AMX CPUs), else fp16 on GPUs, fp32 on CPUs [default: auto]")
    p.add_argument("--quantize", default="auto", choices=("auto", "none", "nf4"),
                   help="nf4: the decoder-layer Linear weights in 4-bit NF4, as a QLoRA fine-tune "
                        "(--quantize nf4) trained on them, quantized from --dtype as training does: give the "
                        "fine-tune's dtype (its summary.json); auto: nf4 when the config.yaml of the run that wrote "
                        "--adapter says --quantize nf4, else none [default: auto]")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="allow a model whose config names its own Python code (auto_map); runs that code")


def cmd_generate(args: argparse.Namespace) -> int:
    from shardtune.runtime.logs import quiet_libraries
    from shardtune.tools.generate import generate_answers, load_model, prompt_text, read_prompts

    quiet_libraries()
    prompts = [args.prompt] if args.prompt is not None else read_prompts(args.prompts)
    model, tokenizer = load_model(args.model, args.adapter, args.dtype, quantize=args.quantize,
                                  trust_remote_code=args.trust_remote_code)
    for i, prompt in enumerate(prompts):
        if len(prompts) > 1:
            print(f"{'' if i == 0 else chr(10)}> {prompt_text(prompt)}", flush=True)
        generate_answers(model, tokenizer, [prompt], args.max_new_tokens, args.temperature, args.top_p,
                         args.seed + i, stream=sys.stdout)
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from shardtune.runtime.logs import quiet_libraries
    from shardtune.tools import eval_results as results
    from shardtune.tools.evaluate import evaluate

    quiet_libraries()
    if args.tasks:  # lm-evaluation-harness benchmarks (tools/harness.py)
        _refuse_context_parallel(args, "--tasks")
        return _cmd_harness(args)
    if not args.data:
        from shardtune.errors import InputError

        raise InputError("shardtune eval needs --data FILE (your own data) or --tasks NAME[,NAME] (lm-eval tasks)")
    from shardtune.tools.preference_eval import evaluate_preferences, is_preference_data, table

    out = Path(args.out) if args.out else results.default_out(args.adapter, results.EVAL_FILE)
    results.check_report_to(args.report_to, out)
    results.check_out(out, args.model, args.adapter, args.data)
    if args.reward:  # prompts: the mean reward of the model's own completions, base against adapter
        from shardtune.tools import reward_eval

        _refuse_context_parallel(args, "--reward")
        result = reward_eval.evaluate_rewards(_subject(args), args.data, args.reward, args.reward_weights,
                                              args.max_new_tokens, args.batch_size, args.temperature, args.seed,
                                              args.seq_len, args.data_fields)
        if out is not None:
            results.write_json(out, result)
            results.send(args.report_to, out.parent, results.reward_values(result, args.data))
        print(json.dumps(result, indent=2) if args.json else reward_eval.table(result))
        return 0
    if is_preference_data(args.data, args.data_fields):  # pairs: preference accuracy, base against adapter
        _refuse_context_parallel(args, f"preference pairs ({args.data})")
        result = evaluate_preferences(_subject(args), args.data, args.seq_len, args.batch_size, args.data_fields)
        if out is not None:
            results.write_json(out, result)
            results.send(args.report_to, out.parent, results.preference_values(result, args.data))
        print(json.dumps(result, indent=2) if args.json else table(result))
        return 0
    result = evaluate(args.model, args.data, args.adapter, args.nproc, args.seq_len, args.batch_size,
                      args.max_new_tokens, args.dtype, answers=args.answers, quantize=args.quantize,
                      data_fields=args.data_fields, trust_remote_code=args.trust_remote_code,
                      context_parallel=args.context_parallel)
    if out is not None:
        results.write_json(out, {"model": str(args.model), "adapter": args.adapter, "data": str(args.data), **result})
        results.send(args.report_to, out.parent, results.data_values(result, args.data, args.adapter))
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    rows = [("records", result["records"]), ("target tokens", result["target_tokens"]),
            ("loss", f"{result['loss']:.4f}"), ("perplexity", _num(result["perplexity"]))]
    if result["exact_match"] is not None:
        n = result["questions"]
        rows += [("exact match", f"{result['exact_match']:.3f} ({round(result['exact_match'] * n)}/{n})"),
                 ("contains match", f"{result['contains_match']:.3f} ({round(result['contains_match'] * n)}/{n})")]
    width = max(len(k) for k, _ in rows)
    print("\n".join(f"{k:<{width}}  {v}" for k, v in rows))
    for row in result.get("answers", []):
        mark = "=" if row["exact"] else ("~" if row["contains"] else "x")
        print(f"\n[{mark}] {row['question']}\n    expected: {row['expected']}\n    answer:   {row['answer']}")
    return 0


def _refuse_context_parallel(args: argparse.Namespace, what: str) -> None:
    """--context-parallel cuts the sequences of the loss on --data records; ``what`` runs in one process."""
    if args.context_parallel != 1:
        from shardtune.config import ConfigError

        raise ConfigError(f"option 'context-parallel' ({args.context_parallel}) splits the loss of --data records "
                          f"over --nproc ranks; {what} is evaluated in one process: leave --context-parallel out")


def _subject(args: argparse.Namespace):
    """The model ``eval`` evaluates, from its flags."""
    from shardtune.tools.generate import EvalModel

    return EvalModel(args.model, args.adapter, args.dtype, args.quantize, args.trust_remote_code)


def _cmd_harness(args: argparse.Namespace) -> int:
    from shardtune.tools import eval_results as results
    from shardtune.tools.harness import Tasks, run_tasks, side_by_side

    out = Path(args.out) if args.out else results.default_out(args.adapter, results.HARNESS_FILE)
    results.check_report_to(args.report_to, out)
    results.check_out(out, args.model, args.adapter, args.include_path)
    tasks = Tasks([t for t in args.tasks.split(",") if t], args.limit, args.num_fewshot, args.include_path)
    report = run_tasks(_subject(args), tasks, args.batch_size, out)
    if out is not None:
        results.send(args.report_to, out.parent, results.harness_values(report))
    if args.json:
        print(json.dumps(report["results"], indent=2, default=str))
        return 0
    for label, table in report["table"].items():
        print(f"{label}:\n{table}")
    print(side_by_side(report))
    if "out" in report:
        print(f"wrote {report['out']}")
    return 0


def _num(value: float | None) -> str:
    return "inf" if value is None else f"{value:.3f}"


def cmd_export(args: argparse.Namespace) -> int:
    from shardtune.runtime.logs import quiet_libraries
    from shardtune.tools.export import ExportError, export_gguf

    quiet_libraries()
    if args.check:
        from shardtune.tools.vllm_check import print_check

        if not args.adapter:
            raise ExportError("--check vllm needs --adapter DIR")
        return print_check(args.adapter, args.max_lora_rank)
    if not (args.model and args.out):
        raise ExportError("--model and --out are required (unless --check vllm)")
    result = export_gguf(args.model, args.adapter, args.out, args.quant, force=args.force)
    print(json.dumps(result, indent=2) if args.json else f"wrote {result['out']} ({result['bytes'] / 2**20:.1f} MB, "
          f"{args.quant})" + (f" and {result['modelfile']['path']}" if "modelfile" in result else ""))
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from shardtune.tools.report import write_report

    written = write_report(args.out_dir)
    print("\n".join(f"wrote {path}" for path in written.values()))
    return 0


def add_commands(sub: argparse._SubParsersAction) -> None:
    fmt = argparse.RawDescriptionHelpFormatter

    p = sub.add_parser(
        "generate", formatter_class=fmt, help="Answer prompts with a base model, with or without an adapter.",
        description="Answer prompts with a base model (+ a LoRA adapter), one process, streaming to the terminal.\n"
                    "Prompts are rendered with the tokenizer's chat template as a user turn, as in training.\n\n"
                    "example:\n  shardtune generate --model models/smollm2-135m --adapter runs/zarnovia/adapter \\\n"
                    "      --prompt 'What is the capital of Zarnovia?'")
    _model_flags(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="one prompt (the user message)")
    src.add_argument("--prompts", metavar="FILE", help="a text file of prompts, one per line, or a .jsonl file of "
                     "records: instruction (+ input) or messages (everything before the last assistant turn)")
    p.add_argument("--temperature", type=_number_in(0, float("inf")), default=0.0,
                   help="0: greedy, deterministic; above 0: sampling at this temperature [default: 0]")
    p.add_argument("--top-p", type=_number_in(0, 1, low_open=True), default=1.0,
                   help="nucleus sampling: keep the smallest set of tokens "
                   "whose probability reaches P (only when sampling) [default: 1.0]")
    p.add_argument("--max-new-tokens", type=_at_least(1), default=256, help="longest answer in tokens [default: 256]")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (prompt i uses seed + i) [default: 0]")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser(
        "eval", formatter_class=fmt, help="Loss, perplexity and answer accuracy on a data file.",
        description="Loss and perplexity over every target token of a data file (the training loss rule: summed\n"
                    "cross-entropy / target tokens; perplexity = exp(loss)), and, for records with an expected\n"
                    "answer (instruction: output; messages: last assistant turn), the accuracy of greedy answers.\n"
                    "Answers and expected texts are normalised (strip, casefold, collapse spaces, drop trailing\n"
                    ".,;:!?). exact_match: equal. contains_match: the expected text occurs in the answer as whole\n"
                    "words ('paris' in 'it is paris, of course', but '4' not in '14').\n\n"
                    "With --nproc N every process loads the full model (+ adapter) and takes every N-th record.\n\n"
                    "example:\n  shardtune eval --model models/smollm2-135m --adapter runs/zarnovia/adapter \\\n"
                    "      --data examples/zarnovia_heldout.jsonl --json")
    _model_flags(p)
    p.add_argument("--data", help="data as finetune's --data takes it: .jsonl/.json of instruction, "
                   "messages, text or ShareGPT records, Parquet, CSV, a save_to_disk directory or a cached Hub dataset")
    p.add_argument("--data-fields", default="", metavar="prompt=COL,response=COL",
                   help="column mapping onto the record fields, as finetune's --data-fields [default: none]")
    p.add_argument("--json", action="store_true", help="print one JSON object: loss, perplexity, records, "
                   "target_tokens, questions, exact_match, contains_match (fractions 0..1, null without questions)")
    p.add_argument("--answers", action="store_true",
                   help="also show every question with its expected and generated answer (key 'answers' in --json)")
    p.add_argument("--nproc", type=_at_least(1), default=1,
                   help="worker processes, one per GPU on GPU machines [default: 1]")
    p.add_argument("--context-parallel", type=_at_least(1), default=1, metavar="N",
                   help="cut each sequence of the loss "
                   "over N of the --nproc ranks, as finetune's --context-parallel (each rank still loads the "
                   "whole model; the answers are generated whole) [default: 1]")
    p.add_argument("--seq-len", type=_at_least(1), default=SEQ_LEN,
                   help=f"tokens per record; longer records are cut [default: {SEQ_LEN}]")
    p.add_argument("--batch-size", type=_at_least(1), default=8,
                   help="records per forward pass and per generation batch "
                   "on each process [default: 8]")
    p.add_argument("--max-new-tokens", type=_at_least(0), default=64,
                   help="longest generated answer; 0 skips generation (loss only) [default: 64]")
    p.add_argument("--reward", action="append", metavar="SPEC", help="prompt data (GRPO's): the mean reward of "
                   "the model's completions, base and base + --adapter, by this reward function (as finetune's "
                   "--reward; repeatable)")
    p.add_argument("--reward-weights", metavar="W,W", help="with --reward: one weight per function [default: 1 each]")
    p.add_argument("--temperature", type=_number_in(0, float("inf")), default=0.0,
                   help="with --reward: 0 for greedy completions, above 0 "
                   "sampled (seeded per prompt) [default: 0]")
    p.add_argument("--seed", type=int, default=0, help="with --reward and --temperature > 0: the sampling seed "
                   "[default: 0]")
    p.add_argument("--tasks", metavar="NAME[,NAME]", help="instead of --data: lm-evaluation-harness tasks, on the "
                   "base and on base + --adapter side by side (docs/export.md)")
    p.add_argument("--limit", type=_at_least(1), help="with --tasks: at most N documents per task [default: all]")
    p.add_argument("--num-fewshot", type=_at_least(0), help="with --tasks: K few-shot examples [default: the task's]")
    p.add_argument("--include-path", metavar="DIR", help="with --tasks: a folder of custom task YAML files")
    p.add_argument("--out", help="the JSON file of the results [default: beside the adapter of a fine-tune, "
                   "OUT_DIR/lm_eval.json with --tasks, OUT_DIR/eval.json with --data; else none]")
    p.add_argument("--report-to", default="", metavar="tensorboard,wandb,mlflow",
                   help="also send the results to these trackers of the fine-tune's run (the folder of --out): "
                        "W&B/MLflow continue its run, at its last step [default: none]")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser(
        "export", formatter_class=fmt, help="Base + adapter as one GGUF file for llama.cpp/Ollama; vLLM check.",
        description="Merge the adapter into the base (streamed, one tensor at a time) and write a GGUF file for\n"
                    "llama.cpp and Ollama, with the tokenizer and chat template in its metadata, and an Ollama\n"
                    "Modelfile beside it. Families: llama, mistral, qwen2, qwen3, gemma, gemma2.\n"
                    "--check vllm instead lists what vLLM would refuse in the adapter, with the fix for each\n"
                    "(exit 1 when there is something).\n\n"
                    "examples:\n  shardtune export --model models/smollm2-135m --adapter runs/zarnovia/adapter \\\n"
                    "      --format gguf --out runs/zarnovia/zarnovia.gguf --quant q8_0\n"
                    "  shardtune export --adapter runs/zarnovia/adapter --check vllm")
    p.add_argument("--model", help="the base model directory the adapter was trained on")
    p.add_argument("--adapter", help="LoRA adapter directory (peft format) [default: none, the base alone]")
    p.add_argument("--format", default="gguf", choices=("gguf",), help="output format [default: gguf]")
    p.add_argument("--out", help="the .gguf file to write; its Ollama Modelfile, NAME.Modelfile, goes beside it")
    p.add_argument("--quant", default="f16", help="matrix type: f16, bf16 or q8_0 (norms stay f32) [default: f16]")
    p.add_argument("--force", action="store_true", help="replace an existing --out (and its Modelfile)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--check", choices=("vllm",), help="check the adapter for a serving engine instead of exporting")
    p.add_argument("--max-lora-rank", type=int, default=16,
                   help="with --check vllm: the --max-lora-rank vLLM will be started with [default: 16, vLLM's]")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser(
        "report", formatter_class=fmt, help="Plots and report.md for a fine-tune's output directory.",
        description="Write loss.png (train and validation loss by step), throughput.png (tokens/s by step),\n"
                    "memory.png (peak memory per rank in the load/train/save phases) and report.md (key summary\n"
                    "fields and the plots) into OUT_DIR, from its metrics.jsonl and summary.json.\n\n"
                    "example:\n  shardtune report runs/zarnovia")
    p.add_argument("out_dir", metavar="OUT_DIR", help="the --out directory of a fine-tune")
    p.set_defaults(func=cmd_report)
