"""A stub of vLLM's OpenAI-compatible server, as far as train/generator_client.py uses it: the runtime LoRA
endpoints (each adapter's tensors read when it is loaded, as vLLM reads them), ``/v1/models`` and
``/v1/completions`` answering with token ids (and, asked with ``logprobs: 0``, each token's log-prob as vLLM's
``logprobs.token_logprobs``); ``mode`` makes it misbehave. ``serve`` runs one on a free port of 127.0.0.1 in a
thread of the test process."""

from __future__ import annotations

import contextlib
import json
import math
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


def default_completion(prompt: list[int], j: int, max_tokens: int) -> tuple[list[int], str]:
    """Even j: (prompt length, j, EOS 257), stopped; odd j: j repeated up to the length limit."""
    return ([len(prompt), j, 257], "stop") if j % 2 == 0 else ([j] * max_tokens, "length")


def uniform_logprobs(prompt: list[int], ids: list[int]) -> list[float | None]:
    """Each token at the log-prob of a uniform choice among the tiny models' 259 ids (near what an untrained
    tiny model gives)."""
    return [-math.log(259.0)] * len(ids)


class Stub:
    """vLLM's endpoints; ``mode``: ok, stale (after the first adapter, loads answer success and change nothing),
    wrong-root (an adapter is listed from another folder), no-runtime-lora (the LoRA endpoints do not exist).
    ``complete(prompt ids, completion index, max_tokens) -> (ids, finish_reason)`` makes each choice,
    ``logprobs(prompt ids, completion ids) -> one value per id`` its log-probs when asked."""

    def __init__(self, mode: str = "ok",
                 complete: Callable[[list[int], int, int], tuple[list[int], str]] = default_completion,
                 logprobs: Callable[[list[int], list[int]], list] = uniform_logprobs) -> None:
        self.mode, self.complete, self.logprobs = mode, complete, logprobs
        self.adapters: dict[str, str] = {}
        self.weights: dict[str, dict] = {}  # each loaded adapter's tensors, by name
        self.requests: list[tuple[str, dict]] = []

    def handle(self, method: str, path: str, body: dict) -> tuple[int, object]:
        self.requests.append((path, body))
        if path == "/v1/models":
            listed = [{"id": "base", "root": "/models/base"}]
            listed += [{"id": k, "root": v, "parent": "base"} for k, v in self.adapters.items()]
            return 200, {"object": "list", "data": listed}
        if path == "/v1/load_lora_adapter":
            if self.mode == "no-runtime-lora":
                return 404, {"detail": "Not Found"}
            if not body.get("lora_name") or not body.get("lora_path"):
                return 400, {"object": "error", "message": "Both 'lora_name' and 'lora_path' must be provided."}
            if body["lora_name"] in self.adapters:
                return 400, {"object": "error", "message": f"The lora adapter '{body['lora_name']}' has already "
                             "been loaded."}
            if self.mode == "stale" and self.adapters:
                return 200, "Success"  # answers success but keeps serving what it had
            root = "/elsewhere" if self.mode == "wrong-root" else body["lora_path"]
            self.adapters[body["lora_name"]] = root
            weights = Path(body["lora_path"]) / "adapter_model.safetensors"
            if weights.is_file():
                from safetensors.torch import load_file

                self.weights[body["lora_name"]] = load_file(weights)
            return 200, f"Success: LoRA adapter '{body['lora_name']}' added successfully."
        if path == "/v1/unload_lora_adapter":
            self.adapters.pop(body["lora_name"], None)
            return 200, "Success"
        if path == "/v1/completions":
            if body["model"] not in self.adapters:
                return 404, {"error": f"model {body['model']} does not exist"}
            choices = []
            for p, prompt in enumerate(body["prompt"]):
                for j in range(body["n"]):
                    ids, finish = self.complete(prompt, j, body["max_tokens"])
                    choice = {"index": p * body["n"] + j, "text": "", "token_ids": ids, "finish_reason": finish,
                              "logprobs": None}
                    if body.get("logprobs") is not None:
                        values = self.logprobs(prompt, ids)
                        choice["logprobs"] = {"text_offset": list(range(len(values))), "token_logprobs": values,
                                              "tokens": [f"token_id:{t}" for t in ids],
                                              "top_logprobs": [None] * len(values)}
                    choices.append(choice)
            return 200, {"choices": list(reversed(choices))}
        return 404, {"detail": "Not Found"}

    def loads(self) -> list[str]:
        """The adapter names asked to load, in order."""
        return [body["lora_name"] for path, body in self.requests if path == "/v1/load_lora_adapter"
                and body.get("lora_name")]

    def asked(self) -> list[dict]:
        """The bodies of the completion requests, in order."""
        return [body for path, body in self.requests if path == "/v1/completions"]


@contextlib.contextmanager
def serve(stub: Stub) -> Iterator[str]:
    """``stub`` served on 127.0.0.1 while inside; yields its URL."""

    class Handler(BaseHTTPRequestHandler):
        def _serve(self, method: str) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length) or b"{}")
            code, answer = stub.handle(method, self.path, body)
            data = (answer if isinstance(answer, str) else json.dumps(answer)).encode()
            self.send_response(code)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            self._serve("GET")

        def do_POST(self) -> None:  # noqa: N802
            self._serve("POST")

        def log_message(self, *args) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()
