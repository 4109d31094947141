"""The one rule for every output a command writes, and the claim every writer takes on it.

An output may never be, or be inside, one of its inputs (a GGUF written over the adapter it is made
from, a merged model inside the base model's folder), nor hold one when it replaces a folder whole;
nor lie inside a folder shardtune rotates (``OUT/checkpoints``: ``--keep-last`` deletes old
checkpoints with whatever is in them). An existing output is replaced only when asked (``--overwrite``,
``--force``). ``claim_output`` checks that, takes the output's writer lock (runtime/lock.py), checks
again holding it, and removes what interrupted writes of the same place left (runtime/files.py).
"""

from __future__ import annotations

import re
import signal
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Literal

from shardtune.errors import check_path
from shardtune.runtime.files import OutputError, check_writable, clear_stale
from shardtune.runtime.lock import RunLock
from shardtune.runtime.signals import Interrupted, signal_of

#: Where a fine-tune keeps its resumable checkpoints (OUT/checkpoints/step-N), rotated by --keep-last.
CHECKPOINTS = "checkpoints"
STEP_DIR = re.compile(r"^step-(\d+)$")
#: What a fine-tune writes into its --out: an input there would be replaced or rotated away.
RUN_OUTPUTS = ("adapter", CHECKPOINTS, "config.yaml", "metrics.jsonl", "summary.json", "completions.jsonl")

Kind = Literal["dir", "file", "run"]
Inputs = Iterable[tuple[str, "str | Path | None"]]


def rotated_folder(path: Path) -> Path | None:
    """The checkpoints folder of a run that ``path`` lies in (or is), or None."""
    for folder in (path, *path.parents):
        if folder.name == CHECKPOINTS and folder.is_dir() and any(
                STEP_DIR.match(p.name) or p.name.startswith(".step-") for p in folder.iterdir()):
            return folder
    return None


def _inside(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def check_output(out: str | Path, *, kind: Kind, inputs: Inputs = (), overwrite: bool = False,
                 flag: str = "--overwrite", name: str = "output") -> Path:
    """Refuse an output whose writing would lose something; return it as a Path.

    ``kind``: ``dir`` (a folder written whole and renamed into place), ``file`` (likewise a file) or
    ``run`` (a fine-tune's --out, written into). ``inputs``: (what, path) of everything the command
    reads (a path that does not exist, a Hub id say, is skipped). ``name`` starts the messages.
    """
    out = Path(out).expanduser()
    real = out.resolve()
    for what, given in inputs:
        if given is None or not Path(given).expanduser().exists():
            continue
        source = Path(given).expanduser().resolve()
        if real == source:
            raise OutputError(f"{name} {out} is the {what} {given}: writing it would replace the input; choose "
                              "another output")
        if source.is_dir() and source in real.parents:
            raise OutputError(f"{name} {out} is inside the {what} {given}: writing it would change the input "
                              f"(or, replacing a file of it, destroy it); choose an output outside it")
        if kind == "dir" and _inside(source, real):
            raise OutputError(f"{name} {out} would replace the input {given}: choose another output")
        held = next((part for part in RUN_OUTPUTS if kind == "run" and _inside(source, real / part)), None)
        if held:
            raise OutputError(f"{name} {out}: the {what} {given} is inside {out / held}, which the run writes "
                              f"(or rotates): choose another --out, or move it out first")
    rotated = rotated_folder(real)
    if rotated is not None:
        raise OutputError(f"{name} {out} is inside {rotated}, whose checkpoints shardtune rotates (--keep-last "
                          f"deletes the old ones, with anything inside them): choose an output outside it")
    if out.exists() and kind == "file" and out.is_dir():
        raise OutputError(f"{name} {out} is a directory, not a file: name the file to write")
    if out.exists() and kind != "file" and not out.is_dir():
        raise OutputError(f"{name} {out} is an existing file, not a directory: choose another output")
    if kind == "file":  # the rule of every file a command writes (errors.check_path): its folder must exist
        check_path(out, name, "file", write=True, error=OutputError)
    if kind == "file" and out.exists() and not overwrite:
        raise OutputError(f"{out} already exists: choose another --out, or pass {flag} to replace it")
    if kind == "dir" and out.is_dir() and any(out.iterdir()) and not overwrite:
        raise OutputError(f"output directory {out} already exists and is not empty: "
                          f"choose another, or pass {flag} to replace it")
    check_writable(out.parent if kind == "file" else out)
    return out


@contextmanager
def claim_output(out: str | Path, *, kind: Literal["dir", "file"], command: str, inputs: Inputs = (),
                 overwrite: bool = False, flag: str = "--overwrite", name: str = "output") -> Iterator[Path]:
    """Hold ``out`` for the block: checked (``check_output``), locked against every other writer (two
    ``shardtune merge`` at once: the second is refused, naming the first), checked again under the
    lock, and cleared of what interrupted writes left. ``command``: "merge", "export", ...

    Ctrl-C or SIGTERM (runtime/signals.py) inside the block ends as ``Interrupted`` naming ``out``,
    once the staged writes inside it have removed their temporaries.
    """
    check_output(out, kind=kind, inputs=inputs, overwrite=overwrite, flag=flag, name=name)
    out = Path(out).expanduser()
    with RunLock(out, f"{command}-{uuid.uuid4().hex[:8]}", whole=True, what=f"shardtune {command}"):
        check_output(out, kind=kind, inputs=inputs, overwrite=overwrite, flag=flag, name=name)
        clear_stale(out)
        try:
            yield out
        except KeyboardInterrupt as err:
            signum = signal_of(err)
            raise Interrupted(signum, f"stopped by {signal.Signals(signum).name} while writing {out}: {out} is as it "
                                      f"was (the partial output was removed)") from None
