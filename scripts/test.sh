#!/usr/bin/env bash
# Sets up .venv if needed, then lints and runs the whole test suite (CPU, gloo, 1-2 processes).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
ruff check src tests bench examples scripts
pytest -q "$@"
