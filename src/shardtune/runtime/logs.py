"""Log lines per rank: rank 0 says what happens; other ranks only warn, prefixed with their rank."""

from __future__ import annotations

import logging
import os
import sys
import threading
import warnings


class _RankFormatter(logging.Formatter):
    def __init__(self, rank: int, world_size: int) -> None:
        prefix = f"[rank {rank}] " if world_size > 1 else ""
        super().__init__(f"%(asctime)s {prefix}%(levelname)s %(message)s", datefmt="%H:%M:%S")


# Known-harmless messages from libraries that would bury the progress bar; real warnings pass.
_HARMLESS = (
    r".*is_gradient_checkpointing.*deprecated.*",
    r".*TypedStorage is deprecated.*",
    r".*fan_in_fan_out is set to False but the target module is .Conv1D.*",  # peft sets it right itself
    r".*torch\.distributed\.checkpoint.*FileSystemReader.*",
    r".*barrier\(\).*device_id.*",
    r".*_get_pg_default_device.*",
    r".*No device id is provided.*",
    # FSDP2 warns of any view among a root's outputs (the logits here); no loss changes them in place
    r".*FSDP2-wrapped module .* returned a view tensor.*",
)


# Library log lines that tell a user nothing, by logger: filtered at the source unless --verbose.
_NOISE = {
    "torch.utils._pytree": ("is an Enum subclass",),  # torchao registers its enums the old way
    "torchao": ("Failed to load",),  # each CUDA kernel library torchao ships, on a machine without it
    "torchao.kernel.intmm": ("Detected no triton",),
    # the elastic agent's "failed (exitcode …)" is logged at ERROR, which _LAUNCHER_LOGGERS' level lets through
    "torch.distributed.elastic.multiprocessing.api": ("failed (exitcode",),
}
# The elastic agent's own lines ("Sending process … closing signal", "failed (exitcode …)"): our
# launcher names the failed rank and its error itself.
_LAUNCHER_LOGGERS = ("torch.distributed.elastic", "torch.distributed.launcher")
VERBOSE_ENV = "SHARDTUNE_VERBOSE"
# ``log.warning(..., extra=EVERY_RANK)``: a warning every rank reaches alike (the same data, the same
# checkpoint); rank 0 says it, the others do not repeat it. Warnings without it may differ by rank.
EVERY_RANK = {"same_on_every_rank": True}


class _FirstRankSays(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not getattr(record, "same_on_every_rank", False)


class _DropNoise(logging.Filter):
    def __init__(self, needles: tuple[str, ...]) -> None:
        super().__init__()
        self.needles = needles

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        return not any(n in text for n in self.needles)


def verbose() -> bool:
    """``--verbose`` (or SHARDTUNE_VERBOSE=1, which worker processes inherit): library noise is kept."""
    return os.environ.get(VERBOSE_ENV, "") not in ("", "0")


def set_verbose(on: bool) -> None:
    """Switch for this process and the workers it starts; on, it undoes ``quiet_by_default``."""
    os.environ[VERBOSE_ENV] = "1" if on else "0"
    if on:
        for name in _NOISE:
            logger = logging.getLogger(name)
            for f in [f for f in logger.filters if isinstance(f, _DropNoise)]:
                logger.removeFilter(f)
        for name in _LAUNCHER_LOGGERS:
            logging.getLogger(name).setLevel(logging.NOTSET)


def quiet_by_default() -> None:
    """Filter the known library noise at its loggers; cheap (imports nothing), idempotent, and done
    on ``import shardtune``, so before torch or torchao can print it in any process of a run."""
    if verbose():
        return
    for name, needles in _NOISE.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropNoise) for f in logger.filters):
            logger.addFilter(_DropNoise(needles))
    for name in _LAUNCHER_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    # tqdm.auto in a notebook without ipywidgets; our own bars never ask for it (runtime/progress.py)
    warnings.filterwarnings("ignore", message=r".*IProgress not found.*")


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


def quiet_libraries(imports: bool = True) -> None:
    """Silence what libraries print that says nothing to a user; ``--verbose`` keeps all of it.
    ``imports=False``: all but importing torchao and transformers (seconds), for a caller that has not
    imported them yet; the environment is set in full either way (a worker's starter is started by it)."""
    if verbose():
        return
    quiet_by_default()
    for pattern in _HARMLESS:
        warnings.filterwarnings("ignore", message=pattern)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if not imports:
        return
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
    if rank != 0:
        console.addFilter(_FirstRankSays())
    log.addHandler(console)
    if log_file:
        to_file = LogFile(log_file)
        to_file.setFormatter(_RankFormatter(rank, max(world_size, 2)))
        log.addHandler(to_file)
    return log


class LogFile(logging.FileHandler):
    """``--log-file``: a write that fails (a full disk, a lost permission) ends the run with an OutputError
    naming the file, raised from the logging call in the main thread, not Python's "--- Logging error ---"
    traceback and a run that goes on to exit 0 with an empty log. It is raised once; the handler then
    writes nothing more (the error's own path may log)."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.failure: OSError | None = None
        self.dead = False

    def emit(self, record: logging.LogRecord) -> None:
        if self.dead:
            return
        if self.failure is None:
            super().emit(record)  # an OSError there reaches handleError
        if self.failure is not None and threading.current_thread() is threading.main_thread():
            from shardtune.runtime.files import output_error

            self.dead, failure = True, self.failure
            raise output_error(failure, self.baseFilename)

    def flush(self) -> None:
        from shardtune.runtime.failure import injected_full_disk

        super().flush()
        if not self.dead:  # a test's full disk (runtime/failure.py): SHARDTUNE_TEST_FAIL_AT=full@NAME:0
            injected_full_disk(os.path.basename(self.baseFilename), 0, self.baseFilename)

    def handleError(self, record: logging.LogRecord) -> None:
        err = sys.exc_info()[1]
        if isinstance(err, OSError):
            self.failure = err
        else:
            super().handleError(record)
