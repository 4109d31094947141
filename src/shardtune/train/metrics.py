"""What a run reports: rank 0's progress bar, metrics.jsonl (one line per step), summary.json."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from shardtune.runtime.failure import injected_full_disk
from shardtune.runtime.files import output_error
from shardtune.runtime.progress import tqdm_class


class Progress:
    """One progress bar on rank 0; the other ranks stay quiet.

    Validation results go into the bar's text, not in lines written between its redraws (each such
    line redrew the bar, leaving blank and repeated rows in logs and notebooks); the last one is
    printed once, after the bar, by ``close``. ``paused()`` keeps validation out of the step rate.
    """

    def __init__(self, total: int, initial: int, enabled: bool) -> None:
        self.bar = tqdm_class()(total=total, initial=initial, desc="finetune", unit="step", dynamic_ncols=True,
                                disable=not enabled)
        self.enabled, self.val = enabled, ""
        self.last_val: str | None = None

    def update(self, record: dict[str, Any]) -> None:
        # tok/s counts real tokens (never padding); fill says how much of the computed batch they were
        fill = f" | fill {record['fill_ratio']:.0%}" if record.get("fill_ratio") is not None else ""
        memory = record.get("peak_mb", record["memory_mb"])
        # preference objectives: how many of the batch's pairs the policy already ranks right
        acc = f" | acc {record['rewards/accuracies']:.0%}" if "rewards/accuracies" in record else ""
        # fp16: steps the loss scaler skipped (gradient overflow), said once there are any
        skipped = f" | skipped {record['skipped_steps']}" if record.get("skipped_steps") else ""
        self.bar.set_postfix_str(
            f"loss {record['loss']:.4f}{acc}{skipped}{self.val} | {record['tokens_per_second']:.0f} tok/s{fill} | "
            f"peak {memory:.0f} MiB",
            refresh=False,
        )
        self.bar.update(1)

    def validated(self, step: int, val_loss: float) -> None:
        """After a validation that followed ``update``: show it, and leave its time out of the step rate."""
        self.val = f" | val {val_loss:.4f}"
        self.last_val = f"step {step}: val_loss {val_loss:.4f}"
        self.bar.unpause()

    def write(self, text: str) -> None:
        self.bar.write(text) if not self.bar.disable else None

    def close(self) -> None:
        self.bar.close()
        if self.enabled and self.last_val:
            print(self.last_val, flush=True)


class MetricsLog:
    """Appends one JSON object per optimizer step to metrics.jsonl (rank 0 only).

    A write that fails (a full disk, a lost permission) ends the run with an OutputError naming the
    file, and leaves it as it was before that write: whole lines only, each a step that was done.
    """

    def __init__(self, path: Path, enabled: bool, resume_from_step: int = 0) -> None:
        self.path, self.enabled = path, enabled
        if enabled:
            kept = []
            if resume_from_step and path.is_file():
                # A resumed run replaces the lines of the steps it redoes.
                kept = [ln for ln in path.read_text().splitlines() if ln and json.loads(ln)["step"] <= resume_from_step]
            _replace(path, "".join(line + "\n" for line in kept))

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        line = json.dumps(_finite(record)) + "\n"
        size = self.path.stat().st_size if self.path.is_file() else 0
        try:
            injected_full_disk(self.path.name, int(record["step"]), self.path)
            with self.path.open("a") as f:
                f.write(line)
        except OSError as err:
            try:  # a line half written is no step: cut it off again
                os.truncate(self.path, size)
            except OSError:
                pass
            raise output_error(err, self.path) from None


def _replace(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` under a temporary name first: a failed write leaves the old file whole."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise output_error(err, path) from None


def _finite(record: dict[str, Any]) -> dict[str, Any]:
    # JSON has no NaN/inf; null says "not a number" without breaking readers.
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    _replace(path, json.dumps(_finite(data), indent=2) + "\n")
