"""Warnings about data that will not do what the user thinks, with the numbers and the record that shows it.

Nothing here is an error: the run can go on, but a user who reads these would change something.
"""

from __future__ import annotations

import logging
from pathlib import Path

from shardtune.train.data.pairs import split_pair

log = logging.getLogger("shardtune")

# Roles chat templates know; any other is rendered by the template as it sees fit (often as a user
# turn, or silently dropped), and by the plain layout as an instruction.
KNOWN_ROLES = ("system", "user", "assistant", "tool")


def data_warnings(path: str | Path, records: list[tuple[int, dict]], usable: int, batch_size: int) -> list[str]:
    """The warnings for training data ``path``: its (line, record) pairs, ``usable`` of them with a target."""
    found = []
    if usable < batch_size:
        found.append(f"{path}: only {usable} usable record{'s' * (usable != 1)} for --batch-size {batch_size}: "
                     f"every optimizer step repeats records (each about {batch_size / usable:.1f} times); "
                     f"a batch size of at most {usable} sees each record once per step")
    unknown: dict[str, list[int]] = {}
    for line, record in records:
        for message in record.get("messages", ()) if isinstance(record, dict) else ():
            role = message.get("role") if isinstance(message, dict) else None
            if isinstance(role, str) and role not in KNOWN_ROLES:
                unknown.setdefault(role, []).append(line)
    for role, lines in unknown.items():
        where = ", ".join(str(n) for n in lines[:5]) + (", …" if len(lines) > 5 else "")
        found.append(f"{path}: chat role {role!r} is not one of {', '.join(KNOWN_ROLES)} "
                     f"({len(lines)} message{'s' * (len(lines) != 1)}, record line {where}); "
                     "the chat template renders it as it sees fit, with no loss on it")
    return found


def warn_about_data(path: str | Path, records: list[tuple[int, dict]], usable: int, batch_size: int) -> None:
    for message in data_warnings(path, records, usable, batch_size):
        log.warning("%s", message)


def pair_warnings(path: str | Path, records: list[tuple[int, dict]], truncated: int, seq_len: int) -> list[str]:
    """Warnings with counts: pairs whose chosen and rejected are the same, and pairs cut by ``seq_len``."""
    found = []
    same = [line for line, r in records if split_pair(r)[1] == split_pair(r)[2]]
    if same:
        where = ", ".join(str(n) for n in same[:5]) + (", …" if len(same) > 5 else "")
        found.append(f"{path}: {len(same)} of {len(records)} pairs have the same chosen and rejected response "
                     f"(record {where}): they add nothing to the preference loss")
    if truncated:
        found.append(f"{path}: {truncated} of {len(records)} pairs are longer than --seq-len {seq_len}: their "
                     f"responses are cut at the end (the prompt is kept whole, as TRL's keep_start does)")
    return found
