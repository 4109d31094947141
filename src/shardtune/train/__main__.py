"""``python -m shardtune.train CONFIG.yaml [PLAN.json]``: one rank of a fine-tune (normally started by
``shardtune finetune``, which resolves the run plan; without PLAN.json rank 0 resolves it)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from shardtune.config import build_config, validate
from shardtune.runplan import RunPlan
from shardtune.runtime.distributed import worker_main
from shardtune.runtime.worker_failures import Stopped


def main(argv: list[str] | None = None) -> None:
    from shardtune.train.recipe import run

    argv = sys.argv[1:] if argv is None else argv
    if len(argv) not in (1, 2):
        sys.exit("usage: python -m shardtune.train CONFIG.yaml [PLAN.json]  (normally started by `shardtune "
                 "finetune`, which resolves the run plan; without PLAN.json rank 0 resolves it)")
    cfg = build_config(argv[0])
    validate(cfg)
    plan = RunPlan.from_dict(json.loads(Path(argv[1]).read_text())) if len(argv) == 2 else None
    try:
        run(cfg, plan)
    except Stopped as stop:
        # A stop is no failure: no error file, only the exit code the launcher reads (128 + signal).
        raise SystemExit(stop.exit_code) from None


if __name__ == "__main__":
    worker_main(main)
