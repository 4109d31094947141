"""A worker that says how it started, for test_warm_start.py: ``python -m reporting_worker OUT [MODE]``.

It writes OUT/rank{RANK}.json (its pid, parent, working directory, path, arguments, what was imported before
its first statement), then per MODE: ``ok`` ends, ``exitN`` exits with N, ``sigterm`` dies of its own
SIGTERM, ``wait`` waits for a SIGTERM and then ends with 0.
"""

import sys

IMPORTED_AT_START = sorted(name for name in ("torch", "noisy_import") if name in sys.modules)

import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

if __name__ == "__main__":
    out, mode = Path(sys.argv[1]), (sys.argv[2] if len(sys.argv) > 2 else "ok")
    if mode == "wait":
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    report = {"pid": os.getpid(), "ppid": os.getppid(), "cwd": os.getcwd(), "path0": sys.path[0],
              "argv": sys.argv[1:], "mark": os.environ.get("SHARDTUNE_TEST_MARK"),
              "fail_at": os.environ.get("SHARDTUNE_TEST_FAIL_AT"),
              "imported_at_start": IMPORTED_AT_START}
    (out / f"rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(report))
    print(f"rank {os.environ.get('RANK')} reporting", flush=True)
    if mode.startswith("exit"):
        sys.exit(int(mode.removeprefix("exit")))
    if mode == "sigterm":
        os.kill(os.getpid(), signal.SIGTERM)
    while mode in ("wait", "sigterm"):
        time.sleep(0.1)
