#!/usr/bin/env bash
# Sets up .venv if needed, then lints and runs the whole test suite (CPU, gloo, 1-4 processes a test) in two
# pytest processes (pytest-xdist; a test file stays in one, with its module fixtures), printing the 25
# slowest tests. Extra arguments go to pytest (e.g. -n 0 for one process, or a test file).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
ruff check src tests bench examples scripts
pytest -q -n 2 --dist loadfile --durations=25 "$@"
