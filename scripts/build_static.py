"""Build the demo as plain files for any static host: web/dist/ (run scripts/setup_web.sh first).

    python scripts/build_static.py [--out web/dist] [--pyodide URL] [--model GGUF] [--model-url URL]

--pyodide URL   load Pyodide (and its numpy/micropip) from URL, e.g. https://cdn.jsdelivr.net/pyodide/v0.28.3/full/
                instead of shipping web/vendor/pyodide/ (a deployment can also edit config.js, or open the
                page with ?pyodide=<url>)
--model GGUF    copy a model into dist/model/ and offer it as the default model (--model-url: link one)

The page needs no server logic (a service worker, coi_sw.js, adds the cross-origin isolation headers a plain
host does not send, from the second page load on): the worker fetches vendor/manifest.json, the wheels and pyworker.py with
relative URLs. The host must serve .wasm as application/wasm and .mjs/.js as text/javascript (most do).
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WEB = ROOT / "web"
# coi.js + coi_sw.js: the service-worker shim that makes the page cross-origin isolated on hosts without
# COOP/COEP headers (SharedArrayBuffer for ts-mini's matmul threads); model_store.js: the Cache API store.
PAGE_FILES = ["index.html", "app.js", "worker.js", "pyworker.py", "styles.css", "model_store.js", "coi.js", "coi_sw.js"]


def build(out: Path, pyodide: str | None = None, model: Path | None = None, model_url: str | None = None) -> list[str]:
    vendor = WEB / "vendor"
    if not (vendor / "manifest.json").is_file():
        raise SystemExit("web/vendor is not assembled: run `bash scripts/setup_web.sh` first")
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    done = []
    for name in PAGE_FILES:
        shutil.copy2(WEB / name, out / name)
    done.append(f"page: {', '.join(PAGE_FILES)}")
    # vendor/: wheels + manifest always; the Pyodide runtime only when not taken from elsewhere.
    shutil.copytree(vendor / "wheels", out / "vendor" / "wheels")
    shutil.copy2(vendor / "manifest.json", out / "vendor" / "manifest.json")
    if pyodide is None:
        shutil.copytree(vendor / "pyodide", out / "vendor" / "pyodide", ignore=shutil.ignore_patterns(".version"))
        done.append("vendor: pyodide runtime, numpy, micropip, pyengine wheel")
    else:
        done.append(f"vendor: pyengine wheel (Pyodide from {pyodide})")
    ts = ROOT / "ts-mini" / "dist"
    if (ts / "worker.js").is_file():
        shutil.copytree(ts, out / "ts-mini", ignore=shutil.ignore_patterns("*.map", "*.d.ts"))
        done.append("ts-mini: worker build")
    else:
        print("build_static: WARNING: ts-mini/dist/worker.js missing; the TypeScript engine will be unavailable",
              file=sys.stderr)
    default_model = model_url
    if model is not None:
        (out / "model").mkdir()
        shutil.copy2(model, out / "model" / model.name)
        default_model = f"./model/{model.name}"
        done.append(f"model: {model.name}")
    cfg = {"defaultModel": default_model, "pyodide": pyodide, "vendor": "./vendor/", "tsWorker": "./ts-mini/worker.js"}
    (out / "config.js").write_text(
        "// Edit to deploy: pyodide = base URL of pyodide.mjs (null: ./vendor/pyodide/); ?pyodide=<url> overrides.\n"
        f"window.PYENGINE_CONFIG = {json.dumps(cfg, indent=2)};\n")
    done.append(f"config.js: {cfg}")
    return done


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=WEB / "dist")
    p.add_argument("--pyodide", default=None, metavar="URL")
    p.add_argument("--model", type=Path, default=None, metavar="GGUF")
    p.add_argument("--model-url", default=None, metavar="URL")
    a = p.parse_args(argv)
    if a.model is not None and not a.model.is_file():
        p.error(f"model file not found: {a.model}")
    for line in build(a.out.resolve(), a.pyodide, a.model, a.model_url):
        print("build_static:", line)
    print(f"build_static: wrote {a.out} (serve it with any static server, e.g. python -m http.server -d {a.out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
