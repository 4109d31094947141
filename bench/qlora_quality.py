"""How far the NF4 base is from the bf16 one: relative logit error on held-out prompts.

    flock /tmp/bigrun.lock .venv/bin/python bench/qlora_quality.py --model models/smollm2-135m

Both models are built the way `shardtune eval` builds them (--quantize nf4: decoder-layer Linear
weights quantized from bf16), compute in fp32; the error is ||nf4 - bf16|| / ||bf16|| over all
logits of each prompt (rendered with the chat template), and the top-1 agreement of the next token.
Two reference rows put the number in scale: torchao's own path (``to_nf4`` on each whole weight,
torchao's dequantization) and a plain symmetric 4-bit absmax quantizer with the same 64-weight
blocks; if shardtune's error is theirs, it is the model's sensitivity to 4 bits, not our code.
(SmolLM2-135M measured here: every 4-bit variant ~0.53, int8 per row 0.04 — small models lose much
more to 4 bits than 7B ones do, and this checkpoint comes from a Q4_1 GGUF to begin with.)
Writes bench/results/qlora-quality.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from record import run_record

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
    ids = [torch.tensor([prompt_ids(tokenizer, prompt)]) for prompt in prompts]
    with torch.no_grad():
        base = [ref(input_ids=i).logits.float() for i in ids]
        rows = compare(base, nf4, ids)
        references = {name: mean_of(compare(base, with_weights(ref, fn), ids))
                      for name, fn in (("torchao_to_nf4_whole", torchao_nf4), ("absmax_int4_block64", absmax_int4),
                                       ("int8_per_row", int8_per_row))}
    mean = mean_of(rows)
    for r in rows:
        print(f"{r['tokens']:4d} tokens  relative logit error {r['relative_error']:.4f}  "
              f"top-1 agreement {r['top1_agreement']:.3f}")
    print(f"mean over {len(rows)} prompts: relative logit error {mean['relative_error']:.4f}, "
          f"top-1 agreement {mean['top1_agreement']:.3f}")
    for name, m in references.items():
        print(f"reference {name:<22} relative logit error {m['relative_error']:.4f}, "
              f"top-1 agreement {m['top1_agreement']:.3f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"model": args.model, "prompts": rows, "mean": mean, "references": references,
                                    **run_record()}, indent=2) + "\n")


def compare(base: list[torch.Tensor], model: torch.nn.Module, ids: list[torch.Tensor]) -> list[dict]:
    rows = []
    for a, i in zip(base, ids):
        b = model(input_ids=i).logits.float()
        rows.append({"tokens": i.shape[1], "relative_error": float((b - a).norm() / a.norm()),
                     "top1_agreement": float((a.argmax(-1) == b.argmax(-1)).float().mean())})
    return rows


def mean_of(rows: list[dict]) -> dict:
    return {k: sum(r[k] for r in rows) / len(rows) for k in ("relative_error", "top1_agreement")}


def with_weights(model: torch.nn.Module, fn) -> torch.nn.Module:
    """A copy of ``model`` whose decoder-layer Linear weights are ``fn(weight)`` (fp32 compute)."""
    import copy

    out = copy.deepcopy(model)
    for name, module in out.named_modules():
        if type(module) is torch.nn.Linear and ".layers." in name:
            module.weight.data = fn(module.weight.data).float()
    return out


def torchao_nf4(w: torch.Tensor) -> torch.Tensor:
    from shardtune.model.nf4_torchao import nf4_module
    from shardtune.model.quantize import scaler_block_size

    cls = nf4_module().NF4Tensor
    t = nf4_module().to_nf4(w.bfloat16().contiguous(), 64, scaler_block_size(w.shape[1]))
    return getattr(cls, "_torchao_get_original_weight", cls.get_original_weight)(t)


def absmax_int4(w: torch.Tensor) -> torch.Tensor:
    blocks = w.reshape(-1, 64)
    scale = blocks.abs().amax(1, keepdim=True) / 7
    return ((blocks / scale).round().clamp(-8, 7) * scale).reshape(w.shape)


def int8_per_row(w: torch.Tensor) -> torch.Tensor:
    scale = w.abs().amax(1, keepdim=True) / 127
    return (w / scale).round() * scale


if __name__ == "__main__":
    main()
