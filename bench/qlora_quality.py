"""How far the NF4 base is from the bf16 one: relative logit error on held-out prompts.

    flock /tmp/bigrun.lock .venv/bin/python bench/qlora_quality.py --model models/smollm2-135m

Both models are built the way `shardtune eval` builds them (--quantize nf4: decoder-layer Linear
weights quantized from bf16), compute in fp32; the error is ||nf4 - bf16|| / ||bf16|| over all
logits of each prompt (rendered with the chat template), and the top-1 agreement of the next token.
Writes bench/results/qlora-quality.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


def main() -> None:
    from shardtune.runtime.logs import quiet_libraries
    from shardtune.tools.generate import load_model, prompt_ids, read_prompts

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="models/smollm2-135m")
    parser.add_argument("--prompts", default=str(HERE.parent / "examples" / "zarnovia_heldout.jsonl"))
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--out", type=Path, default=HERE / "results" / "qlora-quality.json")
    args = parser.parse_args()
    quiet_libraries()
    prompts = read_prompts(args.prompts)[: args.n]
    ref, tokenizer = load_model(args.model, dtype="fp32")
    ref = ref.to(torch.bfloat16).float()  # the bf16 base, computed in fp32
    nf4, _ = load_model(args.model, dtype="auto", quantize="nf4")
    rows = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt_ids(tokenizer, prompt)])
            a, b = ref(input_ids=ids).logits.float(), nf4(input_ids=ids).logits.float()
            rows.append({"tokens": ids.shape[1], "relative_error": float((b - a).norm() / a.norm()),
                         "top1_agreement": float((a.argmax(-1) == b.argmax(-1)).float().mean())})
    mean = {k: sum(r[k] for r in rows) / len(rows) for k in ("relative_error", "top1_agreement")}
    for r in rows:
        print(f"{r['tokens']:4d} tokens  relative logit error {r['relative_error']:.4f}  "
              f"top-1 agreement {r['top1_agreement']:.3f}")
    print(f"mean over {len(rows)} prompts: relative logit error {mean['relative_error']:.4f}, "
          f"top-1 agreement {mean['top1_agreement']:.3f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"model": args.model, "prompts": rows, "mean": mean}, indent=2) + "\n")


if __name__ == "__main__":
    main()
