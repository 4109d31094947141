"""Sub-commands that use a trained adapter or a finished run: generate, eval, report.

Kept apart from cli.py so that its fine-tune commands and these evolve without touching each other;
``add_commands`` hangs them on the main parser. Heavy imports happen inside the commands, so
``shardtune --help`` stays fast.
"""

from __future__ import annotations

import argparse
import json
import sys

from shardtune.config import DataConfig

SEQ_LEN = DataConfig().seq_len


def _model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="Hugging Face model directory or Hub id org/name[@revision] "
                   "(the base the adapter was trained on)")
    p.add_argument("--adapter", help="LoRA adapter directory in peft format, e.g. OUT_DIR/adapter of a fine-tune "
                                     "[default: none, the base model alone]")
    p.add_argument("--dtype", default="auto", choices=("auto", "bf16", "fp16", "fp32"),
                   help="weights and compute dtype; auto: bf16 where the device computes in it natively "
                        "(Ampere+ GPUs, AVX512/AMX CPUs), else fp16 on GPUs, fp32 on CPUs [default: auto]")
    p.add_argument("--quantize", default="none", choices=("none", "nf4"),
                   help="nf4: the decoder-layer Linear weights in 4-bit NF4, as a QLoRA fine-tune "
                        "(--quantize nf4) trained on them, quantized from --dtype as training does: give the "
                        "fine-tune's dtype (its config.yaml) [default: none]")
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
    from shardtune.tools.evaluate import evaluate

    quiet_libraries()
    from shardtune.tools.preference_eval import evaluate_preferences, is_preference_data, table

    if is_preference_data(args.data, args.data_fields):  # pairs: preference accuracy, base against adapter
        result = evaluate_preferences(args.model, args.data, args.adapter, args.seq_len, args.batch_size,
                                      args.dtype, args.quantize, args.data_fields, args.trust_remote_code)
        print(json.dumps(result, indent=2) if args.json else table(result))
        return 0
    result = evaluate(args.model, args.data, args.adapter, args.nproc, args.seq_len, args.batch_size,
                      args.max_new_tokens, args.dtype, answers=args.answers, quantize=args.quantize,
                      data_fields=args.data_fields, trust_remote_code=args.trust_remote_code)
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


def _num(value: float | None) -> str:
    return "inf" if value is None else f"{value:.3f}"


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
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0: greedy, deterministic; above 0: sampling at this temperature [default: 0]")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep the smallest set of tokens "
                   "whose probability reaches P (only when sampling) [default: 1.0]")
    p.add_argument("--max-new-tokens", type=int, default=256, help="longest answer in tokens [default: 256]")
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
    p.add_argument("--data", required=True, help="data as finetune's --data takes it: .jsonl/.json of instruction, "
                   "messages, text or ShareGPT records, Parquet, CSV, a save_to_disk directory or a cached Hub dataset")
    p.add_argument("--data-fields", default="", metavar="prompt=COL,response=COL",
                   help="column mapping onto the record fields, as finetune's --data-fields [default: none]")
    p.add_argument("--json", action="store_true", help="print one JSON object: loss, perplexity, records, "
                   "target_tokens, questions, exact_match, contains_match (fractions 0..1, null without questions)")
    p.add_argument("--answers", action="store_true",
                   help="also show every question with its expected and generated answer (key 'answers' in --json)")
    p.add_argument("--nproc", type=int, default=1, help="worker processes, one per GPU on GPU machines [default: 1]")
    p.add_argument("--seq-len", type=int, default=SEQ_LEN,
                   help=f"tokens per record; longer records are cut [default: {SEQ_LEN}]")
    p.add_argument("--batch-size", type=int, default=8, help="records per forward pass and per generation batch "
                   "on each process [default: 8]")
    p.add_argument("--max-new-tokens", type=int, default=64,
                   help="longest generated answer; 0 skips generation (loss only) [default: 64]")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser(
        "report", formatter_class=fmt, help="Plots and report.md for a fine-tune's output directory.",
        description="Write loss.png (train and validation loss by step), throughput.png (tokens/s by step),\n"
                    "memory.png (peak memory per rank in the load/train/save phases) and report.md (key summary\n"
                    "fields and the plots) into OUT_DIR, from its metrics.jsonl and summary.json.\n\n"
                    "example:\n  shardtune report runs/zarnovia")
    p.add_argument("out_dir", metavar="OUT_DIR", help="the --out directory of a fine-tune")
    p.set_defaults(func=cmd_report)
