"""The GRPO demo, measured: held-out reward of SmolLM2-135M-Instruct on two-digit sums before and after GRPO.

    nice -n 10 python bench/grpo_demo.py          # from the repository root, after bash scripts/fetch_model.sh

1. trains a LoRA adapter with `shardtune finetune --config examples/grpo_arithmetic.yaml` (the policy samples
   its own answers, examples/grpo_rewards.py scores them);
2. runs `shardtune eval --reward ...` on the held-out prompts (examples/arithmetic_heldout.jsonl, sums the
   training prompts do not hold): one greedy completion per prompt from the base and from base + adapter,
   scored by the same reward functions;
3. prints the table and writes bench/results/grpo-demo.json: the held-out mean reward before/after per reward
   function, a few completions before and after with their rewards, the training reward per step, the
   commands, wall times and the machine (scripts/gen_benchmarks.py renders it into docs/benchmarks.md).

`--reuse` skips the fine-tune when OUT already holds its summary.json and adapter.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

from record import run_record

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
EXAMPLES = ROOT / "examples"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="examples/grpo_arithmetic.yaml", help="[default: %(default)s]")
    p.add_argument("--heldout", default="examples/arithmetic_heldout.jsonl", help="[default: %(default)s]")
    p.add_argument("--steps", type=int, help="optimizer steps [default: the config's]")
    p.add_argument("--nproc", type=int, help="training processes [default: the config's]")
    p.add_argument("--max-new-tokens", type=int, help="held-out completion length [default: the config's "
                   "max-completion-length]")
    p.add_argument("--out", help="the fine-tune's output directory [default: the config's]")
    p.add_argument("--reuse", action="store_true", help="skip the fine-tune when OUT holds its summary and adapter")
    p.add_argument("--result", type=Path, default=HERE / "results" / "grpo-demo.json", help="[default: %(default)s]")
    return p.parse_args(argv)


def _config(path: str) -> dict:
    import yaml

    return yaml.safe_load((ROOT / path).read_text())


def _run(command: list[str]) -> float:
    """Runs a shardtune command from the repository root (its output shown); its wall seconds."""
    print("$ " + shlex.join(command), flush=True)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "shardtune", *command[1:]], cwd=ROOT)
    if done.returncode:
        sys.exit(f"{command[0]} {command[1]} failed with exit code {done.returncode}")
    return round(time.perf_counter() - start, 1)


def _rewards(config: dict) -> tuple[list[str], str | None]:
    rewards = config["reward"] if isinstance(config["reward"], list) else [config["reward"]]
    weights = config.get("reward-weights")
    return rewards, None if weights is None else str(weights)


def run(args: argparse.Namespace) -> dict:
    config = _config(args.config)
    out = args.out or config["out"]
    steps = args.steps or config["steps"]
    rewards, weights = _rewards(config)
    max_new = args.max_new_tokens or config.get("max-completion-length", 64)

    train = ["shardtune", "finetune", "--config", args.config, "--steps", str(steps), "--out", out]
    if args.nproc:
        train += ["--nproc", str(args.nproc)]
    summary_path = ROOT / out / "summary.json"
    if args.reuse and summary_path.is_file() and (ROOT / out / "adapter").is_dir():
        print(f"reusing the fine-tune in {out}", flush=True)
        train_seconds = None
    else:
        train_seconds = _run(train)
    summary = json.loads(summary_path.read_text())

    eval_json = ROOT / out / "eval.json"
    evaluate = ["shardtune", "eval", "--model", config["model"], "--adapter", f"{out}/adapter",
                "--data", args.heldout, "--max-new-tokens", str(max_new), "--batch-size", "64", "--json",
                "--out", str(eval_json.relative_to(ROOT))]
    for r in rewards:
        evaluate += ["--reward", r]
    if weights:
        evaluate += ["--reward-weights", weights]
    eval_seconds = _run(evaluate)
    measured = json.loads(eval_json.read_text())
    before, after = measured["base"], measured["adapter_figures"]

    curve = [json.loads(line) for line in (ROOT / out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    curve = [row for row in curve if "reward" in row]
    names = [k for k in before if k == "reward" or k.startswith("rewards/") or k.startswith("completions/")]
    result = {
        "bench": "grpo-demo", **run_record(),
        "dtype": summary.get("dtype"), "model": config["model"], "config": args.config, "heldout": args.heldout,
        "heldout_prompts": measured["prompts"], "max_new_tokens": max_new,
        "rewards": rewards, "reward_weights": weights or "1 each",
        "training": {k: config.get(k) for k in ("num-generations", "batch-size", "max-completion-length",
                                                "temperature", "lr", "lora-r", "epsilon-high")},
        "finetune": {"strategy": summary.get("strategy"), "world_size": summary.get("world_size"),
                     "steps": summary.get("steps"), "wall_seconds": summary.get("wall_seconds")},
        "heldout_reward": {k: {"before": before[k], "after": after[k]} for k in names},
        "samples": [{"prompt": _question(b["prompt"]), "before": b["completion"], "before_reward": b["reward"],
                     "after": a["completion"], "after_reward": a["reward"]}
                    for b, a in zip(before["samples"], after["samples"])],
        "train_reward_per_step": [round(row["reward"], 4) for row in curve],
        "commands": [shlex.join(train), shlex.join(evaluate)],
        "seconds": {"finetune": train_seconds, "eval": eval_seconds},
    }
    args.result.parent.mkdir(parents=True, exist_ok=True)
    args.result.write_text(json.dumps(result, indent=2) + "\n")
    print()
    print(format_table(result))
    print(f"\nwrote {args.result}")
    return result


def _question(prompt) -> str:
    return prompt if isinstance(prompt, str) else prompt[-1]["content"]


def format_table(result: dict) -> str:
    rows = [(k, v["before"], v["after"]) for k, v in result["heldout_reward"].items()]
    width = max(len(k) for k, _, _ in rows)
    lines = [f"held-out: {result['heldout_prompts']} prompts, greedy; GRPO: {result['finetune']['steps']} steps, "
             f"{result['finetune']['wall_seconds']} s, {result['finetune']['strategy']} on "
             f"{result['finetune']['world_size']} processes", "",
             f"{'':<{width}}  {'base':>8}  {'+ GRPO':>8}"]
    lines += [f"{k:<{width}}  {_fmt(b):>8}  {_fmt(a):>8}" for k, b, a in rows]
    for s in result["samples"]:
        lines += ["", s["prompt"], f"  base   ({_fmt(s['before_reward'])}): {s['before']!r}",
                  f"  + GRPO ({_fmt(s['after_reward'])}): {s['after']!r}"]
    return "\n".join(lines)


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def main(argv: list[str] | None = None) -> None:
    run(parse_args(argv))


if __name__ == "__main__":
    main()
