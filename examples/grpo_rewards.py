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
    """1 when the first number in the completion is the expected answer, else 0."""
    out = []
    for completion, expected in zip(completions, answer):
        found = _NUMBER.search(_text(completion))
        out.append(float(found is not None and found.group() == str(expected)))
    return out


def number_only(prompts, completions, **kwargs) -> list[float]:
    """1 when the completion is a number and nothing else (the prompts ask for it), else 0."""
    return [float(re.fullmatch(r"\s*-?\d+\s*\.?\s*", _text(c)) is not None) for c in completions]
