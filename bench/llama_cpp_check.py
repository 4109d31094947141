"""Does llama.cpp answer the held-out demo questions as the merged model does? (Not CI: it builds llama.cpp.)

    python bench/llama_cpp_check.py [--model models/smollm2-135m --adapter runs/zarnovia/adapter]

1. installs llama-cpp-python with pip (which builds llama.cpp from source: minutes on a small machine);
2. exports the demo's base + adapter with ``shardtune export`` (f16 and q8_0), and merges it with
   ``shardtune merge``;
3. answers each question of examples/zarnovia_heldout.jsonl greedily, rendered with the chat template,
   with llama.cpp (the GGUF, its own tokenizer and template metadata) and with transformers (the merged
   safetensors model), and counts identical answers and correct ones (the expected answer in the answer).

Writes bench/results/llama-cpp-check.json. Run the demo first (python examples/demo.py) for the adapter.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


def shardtune(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "shardtune", *args], check=True)


def transformers_answers(merged: Path, questions: list[str], max_new_tokens: int) -> list[str]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(merged)
    model = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
    answers = []
    for q in questions:
        ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)
        with torch.no_grad():
            out = model.generate(**ids, do_sample=False, max_new_tokens=max_new_tokens)
        answers.append(tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True).strip())
    return answers


def llama_cpp_answers(gguf_file: Path, questions: list[str], max_new_tokens: int) -> list[str]:
    from llama_cpp import Llama

    llm = Llama(model_path=str(gguf_file), n_ctx=512, verbose=False, seed=0)
    answers = []
    for q in questions:
        out = llm.create_chat_completion([{"role": "user", "content": q}], temperature=0.0, top_k=1,
                                         max_tokens=max_new_tokens)
        answers.append(out["choices"][0]["message"]["content"].strip())
    return answers


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(ROOT / "models/smollm2-135m"))
    p.add_argument("--adapter", default=str(ROOT / "runs/zarnovia/adapter"))
    p.add_argument("--heldout", default=str(ROOT / "examples/zarnovia_heldout.jsonl"))
    p.add_argument("--work", default="/tmp/shardtune-llama-cpp")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--no-install", action="store_true", help="llama-cpp-python is already installed")
    args = p.parse_args()
    if not args.no_install:
        subprocess.run([sys.executable, "-m", "pip", "install", "llama-cpp-python"], check=True)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    records = [json.loads(line) for line in Path(args.heldout).read_text().splitlines() if line.strip()]
    questions = [r["instruction"] for r in records]
    shardtune("merge", "--model", args.model, "--adapter", args.adapter, "--out", str(work / "merged"), "--overwrite")
    reference = transformers_answers(work / "merged", questions, args.max_new_tokens)
    result = {"questions": len(questions), "transformers_correct": _correct(reference, records), "quants": {}}
    for quant in ("f16", "q8_0"):
        gguf_file = work / f"zarnovia-{quant}.gguf"
        shardtune("export", "--model", args.model, "--adapter", args.adapter, "--out", str(gguf_file),
                  "--quant", quant, "--force")
        got = llama_cpp_answers(gguf_file, questions, args.max_new_tokens)
        result["quants"][quant] = {
            "same_answer": sum(a == b for a, b in zip(got, reference)),
            "llama_cpp_correct": _correct(got, records),
            "examples": [{"question": q, "transformers": a, "llama_cpp": b}
                         for q, a, b in list(zip(questions, reference, got))[:5]],
        }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "llama-cpp-check.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


def _correct(answers: list[str], records: list[dict]) -> int:
    """Answers that contain the expected answer's key phrase (its last word, e.g. the capital's name)."""
    return sum(r["output"].rstrip(".").split()[-1].lower() in a.lower() for a, r in zip(answers, records))


if __name__ == "__main__":
    main()
