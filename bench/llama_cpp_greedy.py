"""Greedy answers from a GGUF file with llama.cpp, one prompt at a time (run by bench/llama_cpp_check.py).

    python bench/llama_cpp_greedy.py FILE.gguf PROMPTS.json OUT.json [--max-new-tokens N] [--threads T]

PROMPTS.json is a list of prompt texts, already rendered with the chat template (special tokens
written out). For each, llama.cpp's own tokenizer (the GGUF's vocabulary) turns it into ids, special
tokens parsed and no BOS added (the template writes what the model needs), and the next token is
always the argmax of llama.cpp's logits until an end-of-generation token or N tokens. OUT.json
gets, per prompt, the prompt ids, the answer ids and the answer text, and the prompt llama.cpp's
own chat-template code makes of the first question (llama.cpp matches the Jinja template to a
built-in format rather than running it, so it may differ from the template's real output).

Bindings: llama-cpp-py-sync (prebuilt wheels) or else llama-cpp-python; run it in its own process
(bench/glibc238.py may have to preload a library before Python starts).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np


class PySync:
    """llama-cpp-py-sync: its ``Llama`` for loading and tokenizing, the C API it exposes for the rest."""

    name = "llama-cpp-py-sync"

    def __init__(self, path: str, threads: int) -> None:
        import llama_cpp_py_sync
        from llama_cpp_py_sync import Llama

        self.version = f"{llama_cpp_py_sync.__version__} (llama.cpp {llama_cpp_py_sync.__llama_cpp_tag__})"
        self.llm = Llama(path, n_ctx=512, n_threads=threads, n_threads_batch=threads, verbose=False, seed=0)
        self.lib, self.ffi = self.llm._lib, self.llm._ffi

    def tokenize(self, text: str) -> list[int]:
        return self.llm.tokenize(text, add_special=False, parse_special=True)

    def detokenize(self, ids: list[int]) -> str:
        return self.llm.detokenize(ids, remove_special=True, unparse_special=False)

    def greedy(self, ids: list[int], max_new: int) -> list[int]:
        self.llm._clear_context_state()
        n_past, out, n_vocab = self.llm._eval_tokens(ids, 0), [], self.llm.n_vocab
        for _ in range(max_new):
            logits = self.lib.llama_get_logits_ith(self.llm._ctx, -1)
            token = int(np.frombuffer(self.ffi.buffer(logits, n_vocab * 4), dtype=np.float32).argmax())
            if self.lib.llama_vocab_is_eog(self.llm._vocab, token):
                break
            out.append(token)
            n_past = self.llm._eval_tokens([token], n_past)
        return out

    def builtin_template(self, question: str) -> str:
        return self.llm._format_chat_prompt([{"role": "user", "content": question}])[0]


class LlamaCppPython:
    """llama-cpp-python (an sdist: pip builds llama.cpp from source)."""

    name = "llama-cpp-python"

    def __init__(self, path: str, threads: int) -> None:
        import llama_cpp

        self.version = llama_cpp.__version__
        self.llm = llama_cpp.Llama(model_path=path, n_ctx=512, n_threads=threads, verbose=False, seed=0)

    def tokenize(self, text: str) -> list[int]:
        return self.llm.tokenize(text.encode(), add_bos=False, special=True)

    def detokenize(self, ids: list[int]) -> str:
        return self.llm.detokenize(ids).decode("utf-8", errors="replace")

    def greedy(self, ids: list[int], max_new: int) -> list[int]:
        self.llm.reset()
        out = []
        for token in self.llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
            if token == self.llm.token_eos() or len(out) == max_new:
                break
            out.append(token)
        return out

    def builtin_template(self, question: str) -> str:
        return ""  # its chat handlers run the Jinja template itself: nothing to compare


def load(path: str, threads: int) -> PySync | LlamaCppPython:
    try:
        return PySync(path, threads)
    except ImportError:
        return LlamaCppPython(path, threads)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("gguf")
    p.add_argument("prompts")
    p.add_argument("out")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--first-question", default="", help="rendered with llama.cpp's built-in chat template")
    args = p.parse_args()
    engine = load(args.gguf, args.threads)
    rows = []
    for prompt in json.loads(Path(args.prompts).read_text()):
        ids = engine.tokenize(prompt)
        answer = engine.greedy(ids, args.max_new_tokens)
        rows.append({"prompt_ids": ids, "answer_ids": answer, "answer": engine.detokenize(answer).strip()})
        print(f"{len(rows)}: {rows[-1]['answer'][:80]!r}", file=sys.stderr, flush=True)
    out = {"binding": engine.name, "version": engine.version, "rows": rows,
           "builtin_template_prompt": engine.builtin_template(args.first_question) if args.first_question else ""}
    Path(args.out).write_text(json.dumps(out) + "\n")


if __name__ == "__main__":
    main()
