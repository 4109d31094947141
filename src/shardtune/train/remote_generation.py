"""GRPO's completions from a vLLM server (``--vllm-url``), which gets the policy's adapter only.

Before a generation batch is sampled, when the adapter changed since the server last got it (each new batch
after an optimizer step), it is written as a peft folder (only the LoRA tensors are gathered, as for the final
adapter: never a full weight) under ``OUT/generator/`` and loaded through vLLM's runtime LoRA endpoint as
version ``step`` (the optimizer steps taken); the client then checks that the server lists exactly that version
from that folder, and stops the run otherwise (train/generator_client.py). The previous version is unloaded
and its folder removed.

Rank 0 alone talks to the server and hands every rank the whole batch's completions, for three reasons: one
request with ``n = G`` per prompt lets vLLM share each prompt's prefill across its group; the server's
sampling depends only on that one request (its prompts and seed), so the completions do not depend on how
many ranks train; and one client owns the served versions (no two ranks loading and unloading the same name).
Every rank waits in the exchange while rank 0 asks, so a failure there (an HTTP error, a version not served)
is raised on every rank, never leaving the others in a collective. The server must read ``OUT/generator/``
(the same machine, or a shared file system).

The log-probs of the loss are computed by the sharded policy as for its own completions; the server's
numerics differ from the trainer's (another kernel, or a 16-bit base under a --quantize nf4 policy). Unless
--vllm-importance-sampling is off, the server is asked for each sampled token's log-prob too, and the loss is
reweighted by the trainer's over the server's probabilities, as TRL's vLLM importance-sampling correction
(train/sampler_correction.py; the ratio is made in train/rollout.py); with --off-policy-mask-threshold too,
for the mask to measure against them.
"""

from __future__ import annotations

import logging
import shutil
import uuid
from collections.abc import Sequence
from pathlib import Path

from torch import nn

from shardtune.config import Config
from shardtune.model.directory import ModelDir
from shardtune.parallel import Strategy
from shardtune.runtime import distributed
from shardtune.runtime.distributed import Worker
from shardtune.train.adapter import save_adapter
from shardtune.train.generator_client import GeneratorClient, GeneratorError
from shardtune.train.sampler_correction import wants_sampler_logps
from shardtune.train.sampling import Completion, SamplingSettings, completion_seed

log = logging.getLogger("shardtune")

#: under --out: the adapter versions written for the server
FOLDER = "generator"


def check_server(url: str) -> None:
    """Preflight: the server at ``url`` answers and takes runtime LoRA updates; GeneratorError naming the option,
    the URL and what to fix otherwise."""
    try:
        GeneratorClient(url, timeout=15).check()
    except GeneratorError as err:
        raise GeneratorError(f"option 'vllm-url': {err}; start it as VLLM_ALLOW_RUNTIME_LORA_UPDATING=True vllm serve "
                             "BASE --enable-lora --max-lora-rank R (R at least --lora-r), or leave out --vllm-url for "
                             "the policy to generate itself", err.status) from None


class RemoteGenerator:
    """The vLLM server of one run: the adapter versions it serves and the completions it samples (module doc)."""

    def __init__(self, cfg: Config, worker: Worker, strategy: Strategy, adapter_keys: dict[str, str],
                 model_dir: ModelDir, vocab: int) -> None:
        assert cfg.grpo.vllm_url is not None
        self.cfg, self.worker, self.strategy, self.keys, self.model_dir = cfg, worker, strategy, adapter_keys, model_dir
        self.vocab = vocab
        self.folder = Path(cfg.output.out) / FOLDER
        # a name of this process's own: a resumed run, or another run on the same server, loads no name twice
        name = f"shardtune-{uuid.uuid4().hex[:8]}"
        timeout = 0.9 * cfg.parallel.collective_timeout  # the other ranks wait that long in the exchange
        self.client = GeneratorClient(cfg.grpo.vllm_url, name, timeout) if worker.is_main else None
        self.version: int | None = None  # the adapter version the server serves

    def completions(self, model: nn.Module, prompts: Sequence[Sequence[int]], n: int, settings: SamplingSettings,
                    step: int, batch: int) -> list[list[Completion]]:
        """``n`` completions of each prompt (token ids) by the policy as it is at optimizer step ``step``, for
        generation batch ``batch``; on every rank (a collective)."""
        if self.version != step:
            written = save_adapter(model, self.strategy, self.keys, self.folder / f"v{step}", self.cfg.model.path,
                                   self.model_dir)  # a collective: rank 0 writes
        answer: object = None
        if self.client is not None:
            try:
                if self.version != step:
                    self.client.sync(written, step)
                    log.info("generator %s serves adapter version %d (%s)", self.client.url, step, written)
                    if self.version is not None:
                        shutil.rmtree(self.folder / f"v{self.version}", ignore_errors=True)
                seed = completion_seed(self.cfg.train.seed, batch, -1, -1) & 0x7FFFFFFF
                logprobs = wants_sampler_logps(self.cfg.grpo)
                answer = self._checked(self.client.generate(prompts, n, settings, seed, logprobs), settings)
            except GeneratorError as err:
                answer = err
        answer = distributed.all_gather_object(answer)[0] if self.worker.world_size > 1 else answer
        if isinstance(answer, GeneratorError):
            raise answer
        self.version = step
        assert isinstance(answer, list)
        return answer

    def _checked(self, rows: list[list[Completion]], settings: SamplingSettings) -> list[list[Completion]]:
        """The server's completions, refused when the trainer could not score them."""
        assert self.client is not None
        for row in rows:
            for c in row:
                bad = [t for t in c.ids if not isinstance(t, int) or not 0 <= t < self.vocab]
                if bad or len(c.ids) > settings.max_new_tokens:
                    what = (f"token id {bad[0]!r} outside the policy's vocabulary of {self.vocab}" if bad else
                            f"{len(c.ids)} tokens, more than --max-completion-length {settings.max_new_tokens}")
                    raise GeneratorError(f"generator {self.client.url}: a completion has {what}: does it serve "
                                         f"the base model of --model {self.cfg.model.path}?")
        return rows
