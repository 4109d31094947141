"""Write the GRPO demo's prompts: sums of two two-digit numbers, as chat prompts with the answer as a field.

    python examples/make_arithmetic_prompts.py   # writes examples/arithmetic_{train,heldout}.jsonl
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).parent


def prompts(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(10, 49), rng.randint(10, 49)
        question = f"What is {a} + {b}? Answer with the number only."
        out.append({"prompt": [{"role": "user", "content": question}], "answer": str(a + b)})
    return out


def main() -> None:
    for name, n, seed in (("arithmetic_train.jsonl", 256, 0), ("arithmetic_heldout.jsonl", 64, 1)):
        (HERE / name).write_text("".join(json.dumps(r) + "\n" for r in prompts(n, seed)))
        print(f"wrote {HERE / name}")


if __name__ == "__main__":
    main()
