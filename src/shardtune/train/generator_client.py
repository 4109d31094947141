"""An external generator for GRPO's rollouts (a vLLM server), synced by its adapter only.

TRL's vLLM path merges the LoRA adapter into the base and pushes every full weight to the server each step
(a whole-model gather; impossible with a 4-bit base); verl users trained for months on adapters that never
reached the generator, so rollouts kept sampling the initial policy. The protocol here sends only the
adapter (a few MB, written to a folder the server can read) through vLLM's runtime LoRA endpoints, and
checks after each sync that the server serves exactly the version just written, failing loudly otherwise:

    sync(folder, version)   POST /v1/load_lora_adapter {lora_name: NAME-vVERSION, lora_path: folder}
                            GET  /v1/models: an entry NAME-vVERSION whose root is that folder, or GeneratorError
                            POST /v1/unload_lora_adapter {lora_name: the previous version}; GET /v1/models: gone
    generate(prompts, ...)  POST /v1/completions {model: NAME-vVERSION, prompt: token ids, n, seed, the sampling
                            options, stop_token_ids: the EOS ids, return_token_ids: true, with ``logprobs`` also
                            logprobs: 0}: each choice's token ids, whether the length limit cut it, and with
                            ``logprobs`` the log-prob vLLM gave each sampled token (choices[i].logprobs.token_logprobs,
                            one per token id; null where vLLM had none, e.g. a NaN, which TRL leaves uncorrected)
    check()                 before training: GET /v1/models answers, POST /v1/load_lora_adapter exists

The server must allow runtime LoRA updates (``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``, ``--enable-lora``,
``--max-lora-rank`` at least the adapter's). Used by train/remote_generation.py (``--vllm-url``); tested
against a stub server (tests/vllm_stub.py).
"""

from __future__ import annotations

import json
import math
import re
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from shardtune.errors import ShardtuneError
from shardtune.train.sampling import Completion, SamplingSettings


def excerpt(text: str, limit: int = 160) -> str:
    """A server's answer for an error line: its text on one line, HTML tags out (a web server that is no vLLM
    answers with a page), at most ``limit`` characters."""
    flat = " ".join(re.sub(r"<[^>]*>", " ", text).split())
    return flat if len(flat) <= limit else flat[:limit - 1] + "…"


class GeneratorError(ShardtuneError, RuntimeError):
    """The generator server refused, failed, or serves another adapter than the one just synced; ``status``: the
    HTTP status it answered with (None: no answer)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class GeneratorClient:
    """One policy's adapter on a vLLM server: its versions loaded, checked and unloaded in turn."""

    def __init__(self, url: str, name: str = "shardtune-policy", timeout: float = 60.0) -> None:
        self.url, self.name, self.timeout = url.rstrip("/"), name, timeout
        self.current: str | None = None  # the served version's name

    # ------------------------------------------------------------------------------------------ transport

    def _request(self, method: str, path: str, body: dict | None = None) -> object:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(f"{self.url}{path}", data=data, method=method,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:  # noqa: S310 - the user's URL
                text = response.read().decode()
        except urllib.error.HTTPError as err:
            detail = excerpt(err.read().decode(errors="replace"))
            hint = (" (is the server started with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True and --enable-lora?)"
                    if "lora" in path and err.code in (404, 405) else "")
            raise GeneratorError(f"generator {self.url}: {method} {path} answered {err.code}: {detail}{hint}",
                                 err.code) from None
        except (urllib.error.URLError, OSError) as err:
            reason = getattr(err, "reason", err)
            raise GeneratorError(f"generator {self.url}: {method} {path} failed: {reason}") from None
        try:
            return json.loads(text) if text.strip() else None
        except json.JSONDecodeError:
            return text  # vLLM answers the LoRA endpoints with plain text

    def served(self) -> dict[str, str | None]:
        """{model or adapter name: its root (an adapter's folder)} as the server lists them."""
        listing = self._request("GET", "/v1/models")
        if not isinstance(listing, dict) or not isinstance(listing.get("data"), list):
            raise GeneratorError(f"generator {self.url}: GET /v1/models answered no model list: "
                                 f"{excerpt(str(listing))}")
        return {str(m.get("id")): m.get("root") for m in listing["data"] if isinstance(m, dict)}

    # ------------------------------------------------------------------------------------------ the protocol

    def check(self) -> None:
        """Before training: the server answers with a model list, and takes runtime LoRA updates. The probe is a
        load request without a name, which vLLM refuses with 400 when the endpoint exists (404 otherwise)."""
        self.served()
        try:
            self._request("POST", "/v1/load_lora_adapter", {"lora_name": "", "lora_path": ""})
        except GeneratorError as err:
            if err.status != 400:
                raise
            return
        raise GeneratorError(f"generator {self.url}: POST /v1/load_lora_adapter took a request without a name: "
                             "not vLLM's runtime LoRA endpoint")

    def version_name(self, version: int) -> str:
        return f"{self.name}-v{version}"

    def sync(self, adapter_dir: str | Path, version: int) -> str:
        """Serve the adapter in ``adapter_dir`` as version ``version``, checked; the previous version goes."""
        name, folder = self.version_name(version), str(Path(adapter_dir).resolve())
        self._request("POST", "/v1/load_lora_adapter", {"lora_name": name, "lora_path": folder})
        served = self.served()
        if name not in served:
            raise GeneratorError(f"generator {self.url}: after loading adapter version {version} ({folder}) the "
                                 f"server does not list {name!r} (it serves: {', '.join(served) or 'nothing'}): "
                                 "rollouts would sample another policy")
        if served[name] not in (None, folder):
            raise GeneratorError(f"generator {self.url}: {name!r} is served from {served[name]}, not from {folder} "
                                 "just written: rollouts would sample another policy")
        previous, self.current = self.current, name
        if previous is not None and previous != name:
            self._request("POST", "/v1/unload_lora_adapter", {"lora_name": previous})
            if previous in self.served():
                raise GeneratorError(f"generator {self.url}: {previous!r} is still served after unloading it")
        return name

    def generate(self, prompts: Sequence[Sequence[int]], n: int, settings: SamplingSettings,
                 seed: int, logprobs: bool = False) -> list[list[Completion]]:
        """``n`` completions of each prompt (token ids) from the synced version; EOS kept as training keeps it;
        ``logprobs``: with the log-prob the server gave each sampled token (``Completion.logps``)."""
        if self.current is None:
            raise GeneratorError(f"generator {self.url}: generate before any adapter was synced")
        body = {"model": self.current, "prompt": [list(p) for p in prompts], "n": n,
                "max_tokens": settings.max_new_tokens, "stop_token_ids": list(settings.eos_ids),
                "temperature": settings.temperature, "top_p": settings.top_p, "top_k": settings.top_k or -1,
                "seed": seed, "return_token_ids": True, "skip_special_tokens": False,
                "include_stop_str_in_output": True}
        if logprobs:
            body["logprobs"] = 0  # the sampled token's own log-prob, no alternatives
        answer = self._request("POST", "/v1/completions", body)
        choices = answer.get("choices") if isinstance(answer, dict) else None
        if not isinstance(choices, list) or len(choices) != n * len(prompts):
            raise GeneratorError(f"generator {self.url}: asked for {n} completions of {len(prompts)} prompts, got "
                                 f"{len(choices) if isinstance(choices, list) else 'no'} choices")
        out: list[list[Completion]] = [[] for _ in prompts]
        for k, choice in enumerate(sorted(choices, key=lambda c: c.get("index", 0))):
            ids = choice.get("token_ids")
            if not isinstance(ids, list):
                raise GeneratorError(f"generator {self.url}: a choice has no token_ids (a vLLM that supports "
                                     "return_token_ids is needed)")
            logps = self._logprobs(choice, len(ids), f"choice {k} (prompt {k // n}, completion {k % n})") \
                if logprobs else None
            out[k // n].append(Completion(list(ids), truncated=choice.get("finish_reason") == "length", logps=logps))
        return out

    def _logprobs(self, choice: dict, tokens: int, which: str) -> list[float | None]:
        """A choice's ``logprobs.token_logprobs``: one number <= 0 or null per token, or GeneratorError naming the
        request and the choice."""
        where = f"generator {self.url}: POST /v1/completions (model {self.current}) answered {which}"
        found = choice.get("logprobs")
        values = found.get("token_logprobs") if isinstance(found, dict) else None
        if not isinstance(values, list):
            raise GeneratorError(f"{where} without logprobs.token_logprobs, asked with logprobs: 0 (a vLLM "
                                 "OpenAI-compatible server answers them; or set --vllm-importance-sampling off)")
        if len(values) != tokens:
            raise GeneratorError(f"{where} with {len(values)} token log-probs for its {tokens} tokens")
        for t, v in enumerate(values):
            bad = v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or math.isinf(v)
                                     or v > 1e-3)
            if bad:
                raise GeneratorError(f"{where} with log-prob {v!r} at token {t}: not a log-probability (a finite "
                                     "number <= 0, or null)")
        return [None if v is None or math.isnan(v) else float(v) for v in values]
