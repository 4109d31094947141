"""One progress display for every long step (tokenizing, loading, evaluation, merge, export, reference pass).

API::

    from shardtune.runtime.progress import progress

    with progress("eval", total=len(records), unit="record") as bar:
        for batch in batches:
            ...
            bar.advance(len(batch), tokens=n_tokens)   # tokens: optional, shown as tok/s
    # on exit, one summary line: "eval: 40/40 records in 3.2 s (812 tok/s)"

``progress(desc, total, unit="item", enabled=None, summary=True)`` returns a ``Bar`` (a context
manager). ``enabled=None`` draws on rank 0 only (``RANK`` unset or 0), so N ranks never draw N
bars. ``summary`` may also be a function of the finished ``Bar`` giving the line to print (sizes:
``"loaded 1.10 GiB of weights in 12.3 s"``). ``Bar.advance(n=1, tokens=0)`` counts ``n`` items done;
``Bar.note(text)`` sets the text after the counts; ``Bar.close()`` (done by ``with``) draws the last
state and writes the summary line. ``Bar.done`` and ``Bar.tokens`` are what has been counted.

Notebooks get a widget bar when ipywidgets is installed and a text bar otherwise, never tqdm's
"IProgress not found" warning. Bars go to stderr, so a command's result on stdout stays parseable.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import Any

#: seconds before a bar appears
DELAY_S = 2.0


def is_rank_zero() -> bool:
    """This process's rank is 0: the process group's rank once one is up (a script's own spawn may set
    no RANK), else RANK (unset: a single process). torch is not imported for it."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return os.environ.get("RANK", "0") == "0"


def _in_notebook() -> bool:
    shell = sys.modules.get("IPython")
    try:
        ip = shell.get_ipython() if shell is not None else None  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - any IPython oddity means: not a notebook
        return False
    return ip is not None and "IPKernelApp" in getattr(ip, "config", {})


def tqdm_class() -> type:
    """tqdm's notebook bar inside a Jupyter kernel with ipywidgets, its text bar everywhere else."""
    if _in_notebook():
        try:
            import ipywidgets  # noqa: F401 - the widget bar needs it; without it tqdm only warns
            from tqdm.notebook import tqdm as notebook_tqdm

            return notebook_tqdm
        except ImportError:
            pass
    from tqdm import tqdm

    return tqdm


class Bar:
    """A tqdm bar with a token rate and a one-line summary when it ends; see the module docstring."""

    def __init__(self, desc: str, total: int | None, unit: str = "item", enabled: bool | None = None,
                 summary: bool | Callable[[Bar], str] = True, **tqdm_args: Any) -> None:
        self.desc, self.total, self.unit, self.summary = desc, total, unit, summary
        self.enabled = is_rank_zero() if enabled is None else enabled
        self.done, self.tokens, self.started, self.closed = 0, 0, time.perf_counter(), False
        # delay: a step done within it draws nothing (its summary line says it all), so a quick failure's
        # message is the first thing on stderr, not the remains of a bar
        args = {"desc": desc, "total": total, "unit": unit, "dynamic_ncols": True, "file": sys.stderr,
                "disable": not self.enabled, "leave": False, "delay": DELAY_S, **tqdm_args}
        self.bar = tqdm_class()(**args)

    def advance(self, n: int = 1, tokens: int = 0) -> None:
        self.done += n
        self.tokens += tokens
        if self.tokens:
            self.bar.set_postfix_str(f"{self.tokens / max(self.seconds, 1e-9):.0f} tok/s", refresh=False)
        self.bar.update(n)

    def note(self, text: str) -> None:
        self.bar.set_postfix_str(text, refresh=False)

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self.started

    def summary_line(self) -> str:
        units = self.unit if self.done == 1 or self.unit.endswith("s") else f"{self.unit}s"
        counted = f"{self.done}/{self.total}" if self.total is not None else str(self.done)
        rate = f" ({self.tokens / max(self.seconds, 1e-9):.0f} tok/s)" if self.tokens else ""
        return f"{self.desc}: {counted} {units} in {self.seconds:.1f} s{rate}"

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.bar.close()
        if self.enabled and self.summary:
            line = self.summary(self) if callable(self.summary) else self.summary_line()
            print(line, file=sys.stderr, flush=True)

    def __enter__(self) -> Bar:
        return self

    def __exit__(self, kind, value, tb) -> None:
        if kind is None:
            self.close()
        else:  # a failure: no summary that reads like success
            self.closed = True
            self.bar.close()


def progress(desc: str, total: int | None, unit: str = "item", enabled: bool | None = None,
             summary: bool | Callable[[Bar], str] = True, **tqdm_args: Any) -> Bar:
    """A ``Bar``; see the module docstring."""
    return Bar(desc, total, unit, enabled, summary, **tqdm_args)
