"""Before and after DPO: does SmolLM2-135M prefer true facts about the invented Zarnovia over false ones?

    python examples/demo_preference.py   # from the repository root (the config's paths are relative to it)

1. scores the base model on held-out preference pairs (examples/zarnovia_pairs_heldout.jsonl): the share
   of pairs whose true answer it finds more likely than the false one, and asks it the held-out questions;
2. trains DPO with examples/zarnovia_dpo.yaml (through shardtune.finetune, 2 processes);
3. scores base + adapter the same way, and prints both side by side with a few answers;
   writes OUT_DIR/before_after.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from demo import side_by_side  # noqa: E402  (the SFT demo's answer table)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(HERE / "zarnovia_dpo.yaml"), help="fine-tune config [default: %(default)s]")
    p.add_argument("--pairs", default=str(HERE / "zarnovia_pairs_heldout.jsonl"), help="held-out pairs")
    p.add_argument("--questions", default=str(HERE / "zarnovia_heldout.jsonl"), help="held-out questions")
    p.add_argument("--nproc", type=int, help="fine-tune processes [default: the config's]")
    p.add_argument("--show", type=int, default=4, help="answers to show side by side [default: 4]")
    p.add_argument("--out", help="output directory [default: the config's]")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    import shardtune
    from shardtune.config import build_config
    from shardtune.runtime.logs import quiet_libraries
    from shardtune.tools.evaluate import evaluate
    from shardtune.tools.generate import EvalModel
    from shardtune.tools.preference_eval import evaluate_preferences

    args = parse_args(argv)
    quiet_libraries()
    overrides = {"nproc": args.nproc, "out": args.out}
    cfg = build_config(args.config, overrides)
    out, model = Path(cfg.output.out), cfg.model.path
    ask = dict(seq_len=cfg.data.seq_len, max_new_tokens=40, answers=True)
    print(f"[1/3] base model {model}: held-out questions", flush=True)
    asked_before = evaluate(model, args.questions, **ask)
    print(f"[2/3] DPO with {args.config} → {out}", flush=True)
    summary = shardtune.finetune(args.config, **overrides)
    adapter = summary.get("adapter") or out / "adapter"
    print("[3/3] base and base + adapter on the held-out pairs and questions", flush=True)
    pairs = evaluate_preferences(EvalModel(str(model), str(adapter)), args.pairs, seq_len=cfg.data.seq_len)
    asked_after = evaluate(model, args.questions, adapter=adapter, **ask)
    base, tuned = pairs["base"], pairs["adapter_figures"]
    lines = [f"{'':<44}{'before':>10}{'after':>10}   ({pairs['pairs']} held-out pairs)",
             f"{'prefers the true answer (log p)':<44}{base['accuracy']:>10.0%}{tuned['accuracy']:>10.0%}",
             f"{'mean margin log p(true) - log p(false)':<44}{base['mean_margin']:>10.2f}{tuned['mean_margin']:>10.2f}",
             f"{'answers naming the true fact':<44}{asked_before['contains_match']:>10.0%}"
             f"{asked_after['contains_match']:>10.0%}",
             f"DPO: {summary['steps']} steps, {summary['strategy']} on {summary['world_size']} processes, "
             f"{summary['wall_seconds']:.0f} s, loss {summary['train_loss_first']:.3f} → "
             f"{summary['train_loss_last']:.3f}",
             "", *side_by_side(asked_before["answers"], asked_after["answers"], args.show)]
    print("\n" + "\n".join(lines))
    result = {"pairs": pairs, "questions_before": asked_before, "questions_after": asked_after,
              "finetune": {k: summary.get(k) for k in ("strategy", "world_size", "steps", "train_loss_first",
                                                      "train_loss_last", "val_loss", "wall_seconds")}}
    (out / "before_after.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {out / 'before_after.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
