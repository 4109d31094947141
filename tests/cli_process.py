"""``python -m shardtune ARGS`` as a process of its own, started the way shardtune starts its workers.

A fresh ``python -m shardtune`` spends seconds importing torch, transformers and peft before it reads its
arguments, even to print one error line; the suite starts dozens. ``command`` returns the command line of
the warm starter's client (runtime/warm_start.py): the process it starts is forked from a starter that
imported those once under the environment the command is given (as ``warm_start.same_start`` compares
them: one starter per environment, the few most recent kept), then runs ``python -m shardtune ARGS`` in
its working directory. Its exit code, output and signals are the command's, as for the workers the product
starts the same way. What a process group or a terminal does (a Ctrl-C to the whole group, the agent's own
children) is still tested on fresh processes (test_checkpoint.py, test_launch.py).
"""

from __future__ import annotations

import atexit
import os
from collections import OrderedDict

from shardtune.runtime import warm_start

#: What ``shardtune``'s commands import before they read a file: the libraries, and the command modules.
PRELOAD = (*warm_start.PRELOAD, "shardtune.cli", "shardtune.preflight", "shardtune.launch")
KEPT = 3  # starters kept at once: most commands share one environment; each holds the libraries' memory

_starters: OrderedDict[frozenset, warm_start._Starter] = OrderedDict()


def command(args: list[str], env: dict[str, str] | None = None) -> list[str]:
    """The command line that runs ``python -m shardtune *args``; run it with ``env`` (default: this process's)."""
    environ = dict(os.environ if env is None else env)
    key = frozenset(warm_start.same_start(environ).items())
    starter = _starters.pop(key, None)
    if starter is None or not starter.alive():
        starter = warm_start._Starter(environ, preload=PRELOAD)
    _starters[key] = starter
    while len(_starters) > KEPT:
        _starters.popitem(last=False)[1].stop()
    exe, rest = warm_start.client_command(starter.address, {}, "shardtune", [str(a) for a in args])
    return [exe, *rest]


@atexit.register
def _stop_all() -> None:
    while _starters:
        _starters.popitem()[1].stop()
