"""Does llama.cpp answer the held-out demo questions as the merged model does? (Not CI.)

    python bench/llama_cpp_check.py [--model models/smollm2-135m --adapter runs/zarnovia/adapter]

Run the demo first (``python examples/demo.py``) for the adapter. Then:

1. llama.cpp's Python binding: ``llama-cpp-py-sync`` (prebuilt CPU wheels on PyPI:
   ``pip install llama-cpp-py-sync``; on a glibc older than 2.38 bench/glibc238.py makes its
   libraries load) or, if that is not installed, ``llama-cpp-python`` (an sdist: pip builds llama.cpp,
   minutes). ``--install`` pip-installs llama-cpp-py-sync first.
2. ``shardtune export`` writes the demo's base + adapter as GGUF, f16 and q8_0; ``shardtune merge``
   writes the merged safetensors model.
3. Each question of examples/zarnovia_heldout.jsonl is rendered with the chat template stored in the
   GGUF file (by transformers' renderer: the binding's own chat code matches a Jinja template to a
   built-in format rather than running it, and for SmolLM2 drops its default system prompt). Then it
   is answered greedily, up to --max-new-tokens tokens, by transformers on the fp32 merged model (its
   tokenizer) and by llama.cpp on each GGUF (its tokenizer, from the file's vocabulary), in a
   process of its own (bench/llama_cpp_greedy.py).

Writes bench/results/llama-cpp-check.json: per quant, prompts whose llama.cpp ids equal
transformers' ids, identical answers (text and token ids), the mean share of answer tokens before
the first difference, and correct answers by ``shardtune eval``'s contains-match and exact-match,
for llama.cpp and transformers.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from glibc238 import prepare
from record import run_record

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
QUANTS = ("f16", "q8_0")


def shardtune(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "shardtune", *args], check=True)


def gguf_chat_template(gguf_file: Path) -> str:
    from gguf import GGUFReader

    field = GGUFReader(str(gguf_file)).get_field("tokenizer.chat_template")
    if field is None:
        raise SystemExit(f"{gguf_file} has no tokenizer.chat_template")
    return field.contents()


def render(merged: Path, template: str, questions: list[str]) -> tuple[list[str], list[list[int]]]:
    """Prompt texts rendered with ``template`` and transformers' ids for them."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(merged)
    texts = [tok.apply_chat_template([{"role": "user", "content": q}], chat_template=template,
                                     add_generation_prompt=True, tokenize=False) for q in questions]
    return texts, [tok(t, add_special_tokens=False)["input_ids"] for t in texts]


def transformers_answers(merged: Path, prompt_ids: list[list[int]], max_new: int) -> list[dict]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(merged)
    model = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
    rows = []
    for ids in prompt_ids:
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 do_sample=False, max_new_tokens=max_new, pad_token_id=tok.pad_token_id)
        answer = out[0, len(ids):].tolist()
        while answer and answer[-1] in _eos_ids(model):
            answer.pop()
        rows.append({"answer_ids": answer, "answer": tok.decode(answer, skip_special_tokens=True).strip()})
    return rows


def _eos_ids(model) -> set[int]:
    eos = model.generation_config.eos_token_id
    return set(eos if isinstance(eos, list) else [eos] if eos is not None else [])


def llama_cpp_answers(gguf_file: Path, prompts: list[str], work: Path, max_new: int, threads: int,
                      env: dict[str, str], first_question: str) -> dict:
    prompts_file, out_file = work / "prompts.json", work / f"{gguf_file.stem}-answers.json"
    prompts_file.write_text(json.dumps(prompts))
    subprocess.run([sys.executable, str(Path(__file__).with_name("llama_cpp_greedy.py")), str(gguf_file),
                    str(prompts_file), str(out_file), "--max-new-tokens", str(max_new), "--threads", str(threads),
                    "--first-question", first_question], check=True, env={**os.environ, **env})
    return json.loads(out_file.read_text())


def common_prefix_share(a: list[int], b: list[int]) -> float:
    longest = max(len(a), len(b))
    same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return 1.0 if longest == 0 else same / longest


def scores(answers: list[str], expected: list[str]) -> dict:
    from shardtune.tools.evaluate import contains_match, exact_match

    return {"contains_match": sum(contains_match(a, e) for a, e in zip(answers, expected)),
            "exact_match": sum(exact_match(a, e) for a, e in zip(answers, expected))}


def _shown(path: str) -> str:
    """A path inside the repository relative to it (as the docs show it), any other as given."""
    resolved = Path(path).resolve()
    return str(resolved.relative_to(ROOT)) if resolved.is_relative_to(ROOT) else path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(ROOT / "models/smollm2-135m"))
    p.add_argument("--adapter", default=str(ROOT / "runs/zarnovia/adapter"))
    p.add_argument("--heldout", default=str(ROOT / "examples/zarnovia_heldout.jsonl"))
    p.add_argument("--work", default="/tmp/shardtune-llama-cpp")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--threads", type=int, default=min(4, os.cpu_count() or 1), help="llama.cpp threads")
    p.add_argument("--install", action="store_true", help="pip install llama-cpp-py-sync first")
    p.add_argument("--results", default=str(RESULTS / "llama-cpp-check.json"))
    args = p.parse_args()
    if args.install:
        subprocess.run([sys.executable, "-m", "pip", "install", "llama-cpp-py-sync"], check=True)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    env = prepare(work)
    records = [json.loads(line) for line in Path(args.heldout).read_text().splitlines() if line.strip()]
    questions, expected = [r["instruction"] for r in records], [r["output"] for r in records]

    merged = work / "merged"
    # fp32: the merged weights before any rounding, of which each GGUF stores its own rounding
    shardtune("merge", "--model", args.model, "--adapter", args.adapter, "--out", str(merged), "--overwrite",
              "--dtype", "fp32")
    files = {}
    for quant in QUANTS:
        files[quant] = work / f"zarnovia-{quant}.gguf"
        shardtune("export", "--model", args.model, "--adapter", args.adapter, "--out", str(files[quant]),
                  "--quant", quant, "--force")
    template = gguf_chat_template(files[QUANTS[0]])
    prompts, prompt_ids = render(merged, template, questions)
    reference = transformers_answers(merged, prompt_ids, args.max_new_tokens)
    ref_text = [r["answer"] for r in reference]
    result = {"model": _shown(args.model), "adapter": _shown(args.adapter), "heldout": _shown(args.heldout),
              "questions": len(questions),
              "max_new_tokens": args.max_new_tokens, "decoding": "greedy (argmax), no repetition penalty",
              "prompt": "rendered with the GGUF file's chat template by transformers' renderer",
              "transformers": {"dtype": "fp32", **scores(ref_text, expected)}, "quants": {}}
    for quant, gguf_file in files.items():
        got = llama_cpp_answers(gguf_file, prompts, work, args.max_new_tokens, args.threads, env, questions[0])
        rows, text = got["rows"], [r["answer"] for r in got["rows"]]
        result["binding"] = f"{got['binding']} {got['version']}"
        builtin = got["builtin_template_prompt"]
        result["builtin_template_matches"] = (builtin == prompts[0]) if builtin else None
        result["quants"][quant] = {
            "gguf_bytes": gguf_file.stat().st_size,
            "prompt_ids_identical": sum(r["prompt_ids"] == ids for r, ids in zip(rows, prompt_ids)),
            "same_answer_text": sum(a == b for a, b in zip(text, ref_text)),
            "same_answer_tokens": sum(r["answer_ids"] == t["answer_ids"] for r, t in zip(rows, reference)),
            "mean_common_prefix": sum(common_prefix_share(r["answer_ids"], t["answer_ids"])
                                      for r, t in zip(rows, reference)) / len(rows),
            "llama_cpp": scores(text, expected),
            "differing": [{"question": q, "transformers": b, "llama_cpp": a}
                          for q, a, b in zip(questions, text, ref_text) if a != b],
        }
    Path(args.results).parent.mkdir(parents=True, exist_ok=True)
    Path(args.results).write_text(json.dumps({**result, **run_record()}, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
