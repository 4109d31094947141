"""examples/slurm.sbatch: the command line each node runs is a valid multi-node HSDP fine-tune, as the README says."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "examples" / "slurm.sbatch"

# Stand-ins for the cluster: srun runs its command once per node (as one task per node would),
# scontrol names the nodes, and shardtune/torchrun record the arguments they were given.
FAKES = {
    "srun": '#!/bin/bash\nshift  # --kill-on-bad-exit=1\nfor i in $(seq 0 $((SLURM_JOB_NUM_NODES - 1))); do\n'
            '  SLURM_NODEID=$i "$@" || exit 1\ndone\n',
    "scontrol": '#!/bin/bash\necho gpu-a\necho gpu-b\n',
    "shardtune": '#!/bin/bash\npython3 -c \'import json, sys; print(json.dumps(sys.argv[1:]))\' "$@" >> "$RECORD"\n',
    "torchrun": '#!/bin/bash\npython3 -c \'import json, sys; print(json.dumps(sys.argv[1:]))\' "$@" >> "$RECORD"\n',
}


def _run(tmp_path: Path, launcher: str) -> list[list[str]]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in FAKES.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    record = tmp_path / f"{launcher}.jsonl"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "RECORD": str(record), "LAUNCHER": launcher,
           "SLURM_JOB_NUM_NODES": "2", "SLURM_GPUS_ON_NODE": "4", "SLURM_JOB_NODELIST": "gpu-[a-b]",
           "SLURM_JOB_ID": "77", "CONFIG": str(REPO / "examples" / "zarnovia.yaml"), "OUT": str(tmp_path / "out")}
    subprocess.run(["bash", str(SCRIPT)], env=env, check=True, cwd=REPO, timeout=60)
    return [json.loads(line) for line in record.read_text().splitlines()]


def _finetune_config(argv: list[str]):
    from shardtune.cli import _overrides, build_parser
    from shardtune.config import build_config, validate

    args = build_parser().parse_args(argv)
    assert args.command == "finetune"
    cfg = build_config(args.config, _overrides(args))
    validate(cfg)
    return cfg


def test_shardtune_launcher_per_node(tmp_path):
    calls = _run(tmp_path, "shardtune")
    assert len(calls) == 2
    for node, argv in enumerate(calls):
        p = _finetune_config(argv).parallel
        assert (p.nproc, p.nnodes, p.node_rank, p.rdzv_endpoint, p.replicate_groups) == (4, 2, node, "gpu-a:29500", 2)


def test_torchrun_with_c10d_rendezvous(tmp_path):
    from torch.distributed.run import get_args_parser

    calls = _run(tmp_path, "torchrun")
    assert len(calls) == 2 and calls[0] == calls[1]  # torchrun numbers the nodes itself
    args = get_args_parser().parse_args(calls[0])
    assert (args.nnodes, args.nproc_per_node, args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id) == (
        "2", "4", "c10d", "gpu-a:29500", "77")
    assert args.module and args.training_script == "shardtune"
    assert _finetune_config(args.training_script_args).parallel.replicate_groups == 2


@pytest.mark.parametrize("launcher", ["torchrun", "shardtune finetune"])
def test_docs_show_the_scripts_command_lines(launcher):
    lines = [ln.strip() for ln in SCRIPT.read_text().splitlines() if ln.strip().startswith("srun ")]
    line = next(ln for ln in lines if f"bash -c '{launcher} " in ln)
    assert line in (REPO / "docs" / "multi-node.md").read_text()
