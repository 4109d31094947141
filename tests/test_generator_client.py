"""The generator client's adapter-only sync against a stub of vLLM's HTTP API: each version loaded through the
LoRA endpoint and checked, the previous one unloaded, completions read as token ids; a server that serves
another adapter than the one just synced, or refuses runtime LoRA updates, stops with GeneratorError."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from shardtune.train.generator_client import GeneratorClient, GeneratorError
from shardtune.train.sampling import SamplingSettings


class Stub:
    """vLLM's endpoints as far as the client uses them; ``mode`` makes it misbehave."""

    def __init__(self, mode: str = "ok") -> None:
        self.mode = mode
        self.adapters: dict[str, str] = {}
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
            if self.mode == "stale" and self.adapters:
                return 200, "Success"  # answers success but keeps serving what it had
            root = "/elsewhere" if self.mode == "wrong-root" else body["lora_path"]
            self.adapters[body["lora_name"]] = root
            return 200, f"Success: LoRA adapter '{body['lora_name']}' added successfully."
        if path == "/v1/unload_lora_adapter":
            self.adapters.pop(body["lora_name"], None)
            return 200, "Success"
        if path == "/v1/completions":
            if body["model"] not in self.adapters:
                return 404, {"error": f"model {body['model']} does not exist"}
            choices = [{"index": p * body["n"] + j, "text": "",
                        "token_ids": [len(prompt), j, 257] if j % 2 == 0 else [j] * body["max_tokens"],
                        "finish_reason": "stop" if j % 2 == 0 else "length"}
                       for p, prompt in enumerate(body["prompt"]) for j in range(body["n"])]
            return 200, {"choices": list(reversed(choices))}
        return 404, {"detail": "Not Found"}


@pytest.fixture
def server():
    stubs: list[Stub] = []

    def start(mode: str = "ok") -> tuple[str, Stub]:
        stub = Stub(mode)

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
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        stubs.append(httpd)
        return f"http://127.0.0.1:{httpd.server_address[1]}", stub

    yield start
    for httpd in stubs:
        httpd.shutdown()
        httpd.server_close()


SETTINGS = SamplingSettings(max_new_tokens=4, eos_ids=(257,), pad_id=258, temperature=1.0, top_k=0)


def test_each_version_is_loaded_checked_and_the_previous_unloaded(server, tmp_path):
    url, stub = server()
    client = GeneratorClient(url, "policy")
    for version in (1, 2):
        (tmp_path / f"v{version}").mkdir()
        assert client.sync(tmp_path / f"v{version}", version) == f"policy-v{version}"
        assert stub.adapters == {f"policy-v{version}": str((tmp_path / f"v{version}").resolve())}
    loads = [body for path, body in stub.requests if path == "/v1/load_lora_adapter"]
    assert [b["lora_name"] for b in loads] == ["policy-v1", "policy-v2"]  # the adapter only: a folder, no weights
    out = client.generate([[1, 2, 3], [4, 5]], 2, SETTINGS, seed=7)
    assert [[(c.ids, c.truncated) for c in row] for row in out] == [
        [([3, 0, 257], False), ([1, 1, 1, 1], True)], [([2, 0, 257], False), ([1, 1, 1, 1], True)]]
    asked = stub.requests[-1][1]
    assert asked["model"] == "policy-v2" and asked["seed"] == 7 and asked["top_k"] == -1


@pytest.mark.parametrize("mode, expected", [
    ("stale", "does not list 'policy-v2'"),
    ("wrong-root", "is served from /elsewhere"),
    ("no-runtime-lora", "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True"),
])
def test_a_sync_the_server_did_not_take_fails_loudly(server, tmp_path, mode, expected):
    url, _ = server(mode)
    client = GeneratorClient(url, "policy")
    with pytest.raises(GeneratorError) as err:
        client.sync(tmp_path, 1)
        client.sync(tmp_path, 2)
    assert expected in str(err.value)


def test_an_unreachable_server_and_generating_before_a_sync_are_named(tmp_path):
    client = GeneratorClient("http://127.0.0.1:9", "policy", timeout=5)
    with pytest.raises(GeneratorError, match="generator http://127.0.0.1:9: POST /v1/load_lora_adapter failed"):
        client.sync(tmp_path, 1)
    with pytest.raises(GeneratorError, match="before any adapter was synced"):
        client.generate([[1]], 1, SETTINGS, 0)
