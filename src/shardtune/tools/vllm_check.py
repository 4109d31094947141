"""What vLLM would refuse in a LoRA adapter, each with its fix, read from the adapter's config and header.

vLLM serves LoRA adapters on top of the base model it loaded, so it refuses adapters that carry
whole tensors of their own (``modules_to_save``, embedding or ``lm_head`` weights: vLLM#9280), DoRA
(vLLM#6983), and a rank above the server's ``--max-lora-rank`` (16 unless raised). Merging
(``shardtune merge``) and serving the merged model avoids all of these. Only the safetensors header
is read, so the check is instant on any adapter size.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from shardtune.errors import ShardtuneError
from shardtune.model.adapter_dir import check_adapter_dir

VLLM_DEFAULT_MAX_LORA_RANK = 16
_VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the values vLLM's --max-lora-rank accepts
_MERGE = "or merge it (`shardtune merge --model BASE --adapter DIR --out MERGED`) and serve the merged model"


class VllmCheckError(ShardtuneError, ValueError):
    """The check itself was asked wrongly (an option value vLLM would not accept)."""


@dataclass(frozen=True)
class Problem:
    what: str
    fix: str


def vllm_problems(adapter: str | Path, max_lora_rank: int = VLLM_DEFAULT_MAX_LORA_RANK) -> list[Problem]:
    """Everything vLLM would refuse in ``adapter`` (started with ``--max-lora-rank max_lora_rank``, one of the
    values vLLM accepts)."""
    if max_lora_rank not in _VLLM_RANKS:
        raise VllmCheckError(f"option --max-lora-rank {max_lora_rank}: vLLM accepts only "
                             f"{', '.join(map(str, _VLLM_RANKS))}; give the value your vLLM server is started with")
    adapter = Path(adapter)
    config = check_adapter_dir(adapter)
    names = _tensor_names(adapter)
    problems = []
    if config.get("modules_to_save"):
        problems.append(Problem(f"modules_to_save {config['modules_to_save']}: whole trained copies of these modules",
                                f"train without modules_to_save, {_MERGE}"))
    whole = sorted(n for n in names if "lora_" not in n and re.search(r"(embed_tokens|lm_head|wte|embed_in)", n))
    lora_embed = sorted(n for n in names if "lora_embedding_" in n or (".lm_head.lora_" in n))
    if whole:
        problems.append(Problem(f"embedding/lm_head weights in the adapter: {', '.join(whole[:4])}",
                                f"train without embedding/lm_head in --lora-targets or modules_to_save, {_MERGE}"))
    if lora_embed:
        problems.append(Problem(f"LoRA on the embedding or lm_head: {', '.join(lora_embed[:4])}",
                                f"leave embed_tokens/lm_head out of --lora-targets, {_MERGE}"))
    if config.get("use_dora") or any("lora_magnitude_vector" in n for n in names):
        problems.append(Problem("DoRA (use_dora: true)", f"retrain with --lora-variant lora, {_MERGE}"))
    rank = max([int(config.get("r", 0)), *map(int, (config.get("rank_pattern") or {}).values())])
    if rank > max_lora_rank:
        allowed = next((r for r in _VLLM_RANKS if r >= rank), None)
        start = (f"start vLLM with --max-lora-rank {allowed}" if allowed
                 else f"no --max-lora-rank vLLM accepts holds {rank}")
        problems.append(Problem(f"rank {rank} above vLLM's --max-lora-rank {max_lora_rank}",
                                f"{start} (and pass --max-lora-rank {allowed or rank} to this check), or retrain "
                                f"with --lora-r {max_lora_rank}"))
    return problems


def _tensor_names(adapter: Path) -> list[str]:
    weights = adapter / "adapter_model.safetensors"
    if not weights.is_file():
        return []
    with weights.open("rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    return [k for k in header if k != "__metadata__"]


def print_check(adapter: str | Path, max_lora_rank: int = VLLM_DEFAULT_MAX_LORA_RANK) -> int:
    """The CLI's report: 0 when vLLM would load the adapter, 1 (and each problem with its fix) when not."""
    problems = vllm_problems(adapter, max_lora_rank)
    if not problems:
        print(f"vLLM: {adapter} should load as a LoRA adapter (--max-lora-rank {max_lora_rank})")
        return 0
    print(f"vLLM would refuse {adapter}:")
    for p in problems:
        print(f"  - {p.what}\n    fix: {p.fix}")
    return 1


def warn_after_training(summary: dict) -> dict:
    """Log one warning per problem vLLM would have with the fine-tune's adapter; returns ``summary`` as is.

    Never fails the finished run: an adapter that cannot be read here is left to the commands that use it.
    """
    import logging

    adapter = (summary or {}).get("adapter")
    if not adapter or not Path(adapter).is_dir():
        return summary
    try:
        problems = vllm_problems(adapter)
    except (ShardtuneError, OSError, ValueError):
        return summary
    for p in problems:
        logging.getLogger("shardtune").warning("vLLM would refuse %s: %s; fix: %s", adapter, p.what, p.fix)
    return summary
