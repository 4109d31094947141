"""What a run reports: rank 0's progress bar, metrics.jsonl (one line per step), summary.json."""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any

from shardtune.errors import ShardtuneError
from shardtune.runtime.failure import injected_full_disk
from shardtune.runtime.files import output_error, write_text_atomic
from shardtune.runtime.progress import tqdm_class

log = logging.getLogger("shardtune")


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
        # GRPO: the generation batch's mean reward and how many completions the length limit cut
        if "reward" in record:
            acc += f" | reward {record['reward']:.3f} | clipped {record.get('completions/clipped_ratio', 0):.0%}"
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
                # A resumed run replaces the lines of the steps it redoes (and drops a torn last line).
                records, note = read_metrics(path)
                if note:
                    log.warning("%s", note)
                kept = [json.dumps(r) for r in records if r["step"] <= resume_from_step]
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
    write_text_atomic(path, text)


class MetricsError(ShardtuneError, ValueError):
    """A metrics.jsonl line that is no record (and not the torn last line of an interrupted write)."""


def read_metrics(path: Path, error: type[ShardtuneError] = MetricsError, what: str = "metrics record"
                 ) -> tuple[list[dict[str, Any]], str | None]:
    """The records of a metrics.jsonl, in file order, and a note when its last line was dropped.

    The one reader for --resume and ``shardtune report``, and of the other files of a line per step
    (GRPO's completions.jsonl: ``what`` its lines are). Each record is written as one line ending in
    a newline, so a last line without its newline (or only NUL bytes, which a power loss can leave) is
    a write that SIGKILL, an OOM kill or a power loss cut off: normal after a crash, and dropped with a
    note. Any other line that is no JSON object with a ``step`` is ``error`` naming the file and line.
    """
    raw = Path(path).read_bytes()
    lines = raw.split(b"\n")
    torn = lines.pop()  # after the last newline: empty when the file ends with one
    while lines and not lines[-1].strip(b"\0 \t\r"):
        torn = lines.pop() + torn  # NUL-filled (or blank) blocks at the end: a power loss's leftovers
    records = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line.decode("utf-8"))
            if not isinstance(record, dict) or not isinstance(record.get("step"), int):
                raise ValueError
        except UnicodeDecodeError as err:
            byte = f"byte 0x{line[err.start]:02x} at column {err.start + 1}"
            raise error(f"{path}:{n}: not valid UTF-8 ({byte})") from None
        except ValueError:
            raise error(f"{path}:{n}: not a {what} (a JSON object with 'step')") from None
        records.append(record)
    note = None
    if torn.strip(b" \t\r\n"):  # NUL bytes count: a power loss leaves them
        note = (f"{path}: its last line ({len(torn)} bytes) was cut off by an interrupted write (a process killed "
                f"or a power loss mid-write) and is left out; the {len(records)} whole records before it are kept")
    return records, note


def _finite(record: dict[str, Any]) -> dict[str, Any]:
    # JSON has no NaN/inf; null says "not a number" without breaking readers.
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    _replace(path, json.dumps(_finite(data), indent=2) + "\n")
