"""shardtune: LoRA fine-tuning of Hugging Face causal LMs, each rank holding only its shard."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shardtune.runtime.logs import quiet_by_default

__version__ = "0.1.0"

quiet_by_default()  # before torch or torchao is imported in this process (see runtime/logs.py)


def finetune(config: str | Path | dict[str, Any] | None = None, nproc: int | None = None,
             verbose: bool | None = None, **options: Any) -> dict:
    """Run a fine-tune in fresh worker processes and return its summary (the summary.json fields).

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
    _reach_reward_packages([options, config])
    overrides = _named_rewards(dict(options))
    if isinstance(config, dict):
        config = _named_rewards(config)
    if nproc is not None:
        overrides["nproc"] = nproc
    overrides.update(_torchrun_layout())
    asked = build_config(config, overrides)
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


def _reach_reward_packages(sources: list[Any]) -> None:
    """Put the folders of the reward functions' packages that this process imported from its own ``sys.path``
    (a notebook's ``sys.path.append``) on the workers' PYTHONPATH: they import them by name. Set here, inside
    ``finetune``'s ``kept_environ``, so that only the workers inherit it."""
    import os

    given = [r for values in sources if isinstance(values, dict) for r in _as_list(values.get("reward"))]
    if not any(callable(r) for r in given):
        return
    from shardtune.train.rewards import worker_path

    roots = worker_path(given)
    if roots:
        os.environ["PYTHONPATH"] = os.pathsep.join([*roots, *filter(None, [os.environ.get("PYTHONPATH")])])


def _as_list(value: Any) -> list[Any]:
    return list(value) if isinstance(value, (list, tuple)) else [] if value is None else [value]


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
