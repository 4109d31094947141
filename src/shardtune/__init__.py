"""shardtune: LoRA fine-tuning of Hugging Face causal LMs, each rank holding only its shard."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shardtune.runtime.logs import quiet_by_default

__version__ = "0.1.0"

quiet_by_default()  # before torch or torchao is imported in this process (see runtime/logs.py)


def finetune(config: str | Path | dict[str, Any] | None = None, nproc: int | None = None,
             verbose: bool | None = None, **options: Any) -> dict:
    """Run a fine-tune in worker processes of its own and return its summary (the summary.json fields).

    ``config`` is a YAML path or a dict of options named like the CLI flags (``lora-r`` or
    ``lora_r``); keyword ``options`` override it. Works from scripts and notebooks alike.
    ``verbose=True`` keeps the library warnings that are filtered by default (``--verbose``).
    ``os.environ`` is left as it was: what the workers need is set in their environment only.
    """
    from shardtune.runtime.worker_env import kept_environ

    with kept_environ():  # a notebook's os.environ is left as it was
        return _finetune(config, nproc, verbose, options)


def _finetune(config: str | Path | dict[str, Any] | None, nproc: int | None, verbose: bool | None,
              options: dict[str, Any]) -> dict:
    from shardtune.config import build_config
    from shardtune.launch import launch
    from shardtune.preflight import preflight
    from shardtune.runtime.failure import stage

    if verbose is not None:
        from shardtune.runtime.logs import set_verbose

        set_verbose(verbose)
    overrides = _named_rewards(dict(options))
    if isinstance(config, dict):
        config = _named_rewards(config)
    if nproc is not None:
        overrides["nproc"] = nproc
    overrides.update(_torchrun_layout())
    asked = build_config(config, overrides)
    _reach_reward_modules(asked.grpo.reward or [])
    with stage("preflight"):
        cfg, plan = preflight(asked)  # the run plan, resolved once for every rank
    from shardtune.tools.vllm_check import warn_after_training

    return warn_after_training(launch(cfg, plan, asked))  # the adapter vLLM would refuse: say so now


def _named_rewards(values: dict[str, Any]) -> dict[str, Any]:
    """``values`` with reward functions given as function objects (``reward=[fn]``, as TRL's ``reward_funcs``)
    named as ``--reward`` takes them (``rewards.spec_of``): the workers load them by name."""
    given = values.get("reward")
    if given is None:
        return values
    from shardtune.train.rewards import spec_of

    return {**values, "reward": [spec_of(r) for r in given] if isinstance(given, (list, tuple)) else spec_of(given)}


def _reach_reward_modules(specs: list[str]) -> None:
    """Put the folders of the ``--reward module:name`` modules that this process finds through its own
    ``sys.path`` (a notebook's ``sys.path.append``) on the workers' PYTHONPATH: they import them by name
    (``rewards.worker_path``). Set here, inside ``finetune``'s ``kept_environ``, so that only the workers
    inherit it."""
    import os

    if not specs:
        return
    from shardtune.train.rewards import worker_path

    folders = worker_path(specs)
    if folders:
        os.environ["PYTHONPATH"] = os.pathsep.join([*folders, *filter(None, [os.environ.get("PYTHONPATH")])])


def _torchrun_layout() -> dict[str, Any]:
    """Under plain torchrun, the ranks torchrun started replace --nproc/--nnodes: the checks and the
    automatic choice before training must count the ranks that will really train."""
    import os

    from shardtune.runtime.workers import under_torchrun

    if not under_torchrun():
        return {}
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    layout: dict = {"nproc": local, "nnodes": max(1, world // max(1, local))}
    if layout["nnodes"] > 1:  # torchrun did the rendezvous; the endpoint is recorded for the config only
        layout["rdzv-endpoint"] = f"{os.environ.get('MASTER_ADDR', 'localhost')}:{os.environ.get('MASTER_PORT', 0)}"
        layout["node-rank"] = int(os.environ.get("GROUP_RANK", int(os.environ.get("RANK", "0")) // local))
    return layout


def __getattr__(name: str) -> Any:
    # The library loader imports torch and transformers: only when asked for, so `import shardtune` stays light.
    if name == "load_sharded":
        from shardtune.parallel.sharded_model import load_sharded

        return load_sharded
    raise AttributeError(f"module 'shardtune' has no attribute {name!r}")


__all__ = ["finetune", "load_sharded", "__version__"]
