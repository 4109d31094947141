"""Log lines per rank: rank 0 says what happens; other ranks only warn, prefixed with their rank."""

from __future__ import annotations

import logging
import os
import warnings


class _RankFormatter(logging.Formatter):
    def __init__(self, rank: int, world_size: int) -> None:
        prefix = f"[rank {rank}] " if world_size > 1 else ""
        super().__init__(f"%(asctime)s {prefix}%(levelname)s %(message)s", datefmt="%H:%M:%S")


# Known-harmless messages from libraries that would bury the progress bar; real warnings pass.
_HARMLESS = (
    r".*is_gradient_checkpointing.*deprecated.*",
    r".*TypedStorage is deprecated.*",
    r".*torch\.distributed\.checkpoint.*FileSystemReader.*",
    r".*barrier\(\).*device_id.*",
    r".*_get_pg_default_device.*",
    r".*No device id is provided.*",
)


def import_quietly(module: str):
    """Import ``module`` with torchao's import-time noise silenced: it logs a failed load of each CUDA
    kernel library it ships (on CPU-only torch, all of them) and torch's pytree warns about its enums."""
    import contextlib
    import importlib
    import io

    loggers = [logging.getLogger(n) for n in ("torchao", "torch.utils._pytree")]
    levels = [lg.level for lg in loggers]
    try:
        for lg in loggers:
            lg.setLevel(logging.ERROR)
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            return importlib.import_module(module)
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def quiet_libraries() -> None:
    for pattern in _HARMLESS:
        warnings.filterwarnings("ignore", message=pattern)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        import_quietly("torchao")  # transformers and peft import it when installed: take the noise here
    except ImportError:
        pass
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except ImportError:
        pass


def setup_logging(rank: int, log_file: str | None = None) -> logging.Logger:
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    quiet_libraries()
    log = logging.getLogger("shardtune")
    log.handlers.clear()
    log.setLevel(logging.INFO)
    log.propagate = False
    console = logging.StreamHandler()
    console.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    console.setFormatter(_RankFormatter(rank, world_size))
    log.addHandler(console)
    if log_file:
        to_file = logging.FileHandler(log_file)
        to_file.setFormatter(_RankFormatter(rank, max(world_size, 2)))
        log.addHandler(to_file)
    return log
