"""Before and after: what a LoRA fine-tune taught SmolLM2-135M about the invented country of Zarnovia.

    python examples/demo.py            # from the repository root: the config's paths are relative to it

1. evaluates the base model on held-out questions (examples/zarnovia_heldout.jsonl), which it
   cannot know: Zarnovia does not exist;
2. fine-tunes it with examples/zarnovia.yaml (the README's main command, through shardtune.finetune);
3. evaluates base + the new adapter on the same held-out questions;
4. prints accuracy and loss before/after and a few answers side by side, and writes
   OUT_DIR/before_after.json (OUT_DIR is the config's `out`, runs/zarnovia).

Held-out accuracy is `shardtune eval`'s: contains_match counts an answer right when the expected
answer occurs in it as whole words (after casefolding and stripping punctuation); exact_match
needs the whole answer to be just that. Options: `python examples/demo.py --help`.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from pathlib import Path

HERE = Path(__file__).resolve().parent


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(HERE / "zarnovia.yaml"), help="fine-tune config [default: %(default)s]")
    p.add_argument("--heldout", default=str(HERE / "zarnovia_heldout.jsonl"),
                   help="held-out questions, instruction records [default: %(default)s]")
    p.add_argument("--nproc", type=int, help="fine-tune processes [default: the config's]")
    p.add_argument("--eval-nproc", type=int, default=1, help="evaluation processes [default: 1]")
    p.add_argument("--show", type=int, default=4, help="answers to show side by side [default: 4]")
    p.add_argument("--max-new-tokens", type=int, default=48, help="longest generated answer [default: 48]")
    p.add_argument("--quantize", choices=("none", "nf4"), help="QLoRA: train (and evaluate) on the 4-bit NF4 base "
                   "[default: the config's]")
    p.add_argument("--out", help="output directory [default: the config's]")
    p.add_argument("--reuse", action="store_true",
                   help="skip the fine-tune when OUT_DIR already holds its summary.json and adapter")
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> dict:
    import shardtune
    from shardtune.config import build_config
    from shardtune.runtime.logs import quiet_libraries
    from shardtune.tools.evaluate import evaluate

    quiet_libraries()
    overrides = {"nproc": args.nproc, "quantize": args.quantize, "out": args.out}
    cfg = build_config(args.config, overrides)
    out = Path(cfg.output.out)
    measure = dict(nproc=args.eval_nproc, seq_len=cfg.data.seq_len, max_new_tokens=args.max_new_tokens,
                   answers=True, quantize=cfg.model.quantize)

    print(f"[1/3] base model {cfg.model.path} on {args.heldout}", flush=True)
    before = evaluate(cfg.model.path, args.heldout, **measure)
    if args.reuse and (out / "summary.json").is_file() and (out / "adapter").is_dir():
        print(f"[2/3] reusing the fine-tune in {out}", flush=True)
        summary = json.loads((out / "summary.json").read_text())
    else:
        print(f"[2/3] fine-tune with {args.config} → {out}", flush=True)
        summary = shardtune.finetune(args.config, **overrides)
    print("[3/3] base model + adapter on the held-out questions", flush=True)
    after = evaluate(cfg.model.path, args.heldout, adapter=summary.get("adapter") or out / "adapter", **measure)

    result = {"config": str(args.config), "heldout": str(args.heldout), "before": before, "after": after,
              "finetune": {k: summary.get(k) for k in ("strategy", "world_size", "steps", "train_loss_first",
                                                      "train_loss_last", "tokens_per_second", "wall_seconds")}}
    out.mkdir(parents=True, exist_ok=True)
    (out / "before_after.json").write_text(json.dumps(result, indent=2) + "\n")
    print()
    print(format_table(before, after, summary, args.show))
    print(f"\nwrote {out / 'before_after.json'}")
    return result


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:.0f}%"


def format_table(before: dict, after: dict, summary: dict, show: int) -> str:
    n = before["questions"]
    rows = [
        ("held-out contains-match", _pct(before["contains_match"]), _pct(after["contains_match"])),
        ("held-out exact-match", _pct(before["exact_match"]), _pct(after["exact_match"])),
        ("held-out loss", f"{before['loss']:.3f}", f"{after['loss']:.3f}"),
        ("held-out perplexity", _num(before["perplexity"]), _num(after["perplexity"])),
    ]
    lines = [f"{'':<26}{'before':>10}{'after':>10}   ({n} held-out questions)"]
    lines += [f"{label:<26}{b:>10}{a:>10}" for label, b, a in rows]
    lines.append(f"fine-tune: {summary.get('steps')} steps, {summary.get('strategy')} on "
                 f"{summary.get('world_size')} process(es), {summary.get('wall_seconds', 0):.0f} s, "
                 f"train loss {summary.get('train_loss_first', 0):.3f} → {summary.get('train_loss_last', 0):.3f}")
    lines += ["", *side_by_side(before.get("answers", []), after.get("answers", []), show)]
    return "\n".join(lines)


def _num(value: float | None) -> str:
    return "inf" if value is None else f"{value:.2f}"


def side_by_side(before: list[dict], after: list[dict], show: int, width: int = 26) -> list[str]:
    """question | expected | before | after, each cell wrapped to ``width`` columns."""
    header = ("question", "expected", "before", "after")
    lines = [" | ".join(f"{h:<{width}}" for h in header).rstrip(), "-+-".join("-" * width for _ in header)]
    for b, a in list(zip(before, after))[:show]:
        mark_b = "✓ " if b["contains"] else "✗ "
        mark_a = "✓ " if a["contains"] else "✗ "
        cells = [textwrap.wrap(text or "(empty)", width) or [""]
                 for text in (b["question"], b["expected"], mark_b + b["answer"], mark_a + a["answer"])]
        for k in range(min(3, max(len(c) for c in cells))):  # at most 3 lines a row keeps the table readable
            lines.append(" | ".join(f"{(c[k] if k < len(c) else ''):<{width}}" for c in cells).rstrip())
        lines.append("-+-".join("-" * width for _ in header))
    return lines


def main(argv: list[str] | None = None) -> int:
    from shardtune.config import ConfigError
    from shardtune.runtime.worker_failures import WorkerError
    from shardtune.train.data.records import DataError

    args = parse_args(argv)
    try:
        run(args)
    except (ConfigError, DataError, WorkerError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
