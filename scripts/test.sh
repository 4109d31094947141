#!/usr/bin/env bash
# Sets up .venv if needed, then lints and runs the whole test suite (CPU, gloo, 1-4 processes a test) in two
# pytest processes (pytest-xdist; a test file stays in one, with its module fixtures), printing the 25
# slowest tests. Extra arguments go to pytest (e.g. -n 0 for one process, or a test file).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
# Two pytest processes share the cores, each starting workers of its own: one compute thread per process
# (shardtune's workers keep a thread count given, cpu_tuning.worker_env), so OpenMP threads never spin
# against each other. Tests of the worker thread count clear it.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
ruff check src tests bench examples scripts
pytest -q -n 2 --dist loadfile --durations=25 "$@"
