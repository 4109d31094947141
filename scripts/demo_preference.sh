#!/usr/bin/env bash
# Preference tuning on the real SmolLM2-135M-Instruct: DPO on true-vs-false answers about an invented
# country, 2 processes, held-out preference accuracy and answers before and after.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
bash scripts/fetch_model.sh
python examples/demo_preference.py "$@"
