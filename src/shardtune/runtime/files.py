"""Writing directories so that a reader sees the old one or the new one, never half of either."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def replace_dir(tmp: Path, final: Path) -> None:
    """Put a fully written ``tmp`` at ``final``; a reader sees the old or the new one, never half.

    The old ``final`` is removed only once ``tmp`` is in its place; if that move fails, the old one
    is put back, so nothing already written is lost.
    """
    old = final.with_name(f".{final.name}.old")
    if old.exists():
        shutil.rmtree(old)
    if final.exists():
        os.replace(final, old)
    try:
        os.replace(tmp, final)
    except BaseException:
        if old.exists() and not final.exists():
            os.replace(old, final)
        raise
    shutil.rmtree(old, ignore_errors=True)
