"""The generator client's adapter-only sync against a stub of vLLM's HTTP API: each version loaded through the
LoRA endpoint and checked, the previous one unloaded, completions read as token ids; a server that serves
another adapter than the one just synced, or refuses runtime LoRA updates, stops with GeneratorError; the
sampled tokens' log-probs (for the importance-sampling correction) read and checked."""

from __future__ import annotations

import contextlib
import math

import pytest

from shardtune.train.generator_client import GeneratorClient, GeneratorError
from shardtune.train.sampling import SamplingSettings

from vllm_stub import Stub, serve


@pytest.fixture
def server():
    with contextlib.ExitStack() as stack:
        def start(mode: str = "ok") -> tuple[str, Stub]:
            stub = Stub(mode)
            return stack.enter_context(serve(stub)), stub
        yield start


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
    assert asked["stop_token_ids"] == [257] and asked["max_tokens"] == 4 and asked["n"] == 2


def test_the_check_before_training_finds_the_runtime_lora_endpoint(server):
    url, stub = server()
    GeneratorClient(url).check()
    assert stub.adapters == {}  # the probe (a load without a name, refused with 400) loads nothing
    url, _ = server("no-runtime-lora")
    with pytest.raises(GeneratorError, match="answered 404.*VLLM_ALLOW_RUNTIME_LORA_UPDATING=True") as err:
        GeneratorClient(url).check()
    assert err.value.status == 404


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


def test_the_servers_log_probs_are_checked(tmp_path):
    """A server that answers no log-probs, too few, or no log-probability stops the request with the choice named."""
    settings = SETTINGS

    def asked(logprobs) -> str:
        with serve(Stub(logprobs=logprobs)) as url:
            client = GeneratorClient(url)
            client.sync(tmp_path, 0)
            rows = client.generate([[1, 2], [3]], 2, settings, 0)
            assert all(c.logps is None for row in rows for c in row)  # not asked: none
            with pytest.raises(GeneratorError) as err:
                client.generate([[1, 2], [3]], 2, settings, 0, logprobs=True)
        return str(err.value)

    assert "choice 0 (prompt 0, completion 0) with 2 token log-probs for its 3 tokens" in \
        asked(lambda prompt, ids: [-1.0] * (len(ids) - 1))
    assert "log-prob 'x' at token 1" in asked(lambda prompt, ids: [-1.0, "x"] + [-1.0] * (len(ids) - 2))
    assert "log-prob inf" in asked(lambda prompt, ids: [math.inf] * len(ids))
    with serve(Stub(logprobs=lambda prompt, ids: [None if t == 0 else -0.5 for t in range(len(ids))])) as url:
        client = GeneratorClient(url)
        client.sync(tmp_path, 0)
        rows = client.generate([[1, 2]], 2, settings, 0, logprobs=True)
    assert [c.logps for c in rows[0]] == [[None, -0.5, -0.5], [None, -0.5, -0.5, -0.5]]  # null: unscored, as TRL

    stub_less = Stub()
    stub_less.handle = lambda method, path, body, handle=stub_less.handle: _without_logprobs(handle(method, path, body))
    with serve(stub_less) as url:
        client = GeneratorClient(url)
        client.sync(tmp_path, 0)
        with pytest.raises(GeneratorError, match="without logprobs.token_logprobs"):
            client.generate([[1]], 1, settings, 0, logprobs=True)


def _without_logprobs(answer: tuple[int, object]) -> tuple[int, object]:
    code, body = answer
    for choice in body.get("choices", []) if isinstance(body, dict) else []:
        choice["logprobs"] = None
    return code, body


def test_a_web_server_that_is_no_vllm_is_named_in_one_line(tmp_path):
    """A --vllm-url where an ordinary web server answers (its 404 page, HTML): one line, with the status and a
    short excerpt of the page, not the page's markup over a dozen lines."""
    import functools
    import http.server
    import threading

    (tmp_path / "index.html").write_text("<html><body>hello</body></html>")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        client = GeneratorClient(f"http://127.0.0.1:{httpd.server_address[1]}", "policy", timeout=5)
        with pytest.raises(GeneratorError) as failed:
            client.served()
    finally:
        httpd.shutdown()
    message = str(failed.value)
    assert "GET /v1/models answered 404: Error response" in message, message
    assert "\n" not in message and "<" not in message and len(message) < 300, message
