"""Reward functions for the GRPO demo (examples/grpo_arithmetic.yaml), in TRL's convention: verifiable, so the
reward says exactly whether the model got the sum right.

    shardtune finetune --config examples/grpo_arithmetic.yaml
    shardtune eval --model models/smollm2-135m --adapter runs/grpo-arithmetic/adapter \
        --data examples/arithmetic_heldout.jsonl --reward examples/grpo_rewards.py:correct_answer
"""

from __future__ import annotations

import re

_NUMBER = re.compile(r"-?\d+")


def _text(completion) -> str:
    """A completion's text: the string, or the content of its assistant message (chat prompts)."""
    return completion if isinstance(completion, str) else completion[-1]["content"]


def correct_answer(prompts, completions, answer, **kwargs) -> list[float]:
    """1 when the last number in the completion is the expected answer, else 0: "64" and "18 + 46 = 64" are
    both right (the base model likes to restate the sum), "18 + 46 = 63" and "To add 18 and 46, ..." are not."""
    out = []
    for completion, expected in zip(completions, answer):
        found = _NUMBER.findall(_text(completion))
        out.append(float(bool(found) and found[-1] == str(expected)))
    return out


def number_only(prompts, completions, **kwargs) -> list[float]:
    """1 when the completion is a number and nothing else (the prompts ask for it), else 0."""
    return [float(re.fullmatch(r"\s*-?\d+\s*\.?\s*", _text(c)) is not None) for c in completions]
