"""Regenerate tests/golden/chat_templates_families.json: the published chat templates of the families S21 added,
read out of files shipped in a PyPI package (never in CI; it downloads a 76 MB sdist).

    .venv/bin/python scripts/make_golden_chat_families.py

llama-cpp-python's sdist vendors llama.cpp's models/templates/, copies of the templates as the models publish
them (tokenizer_config.json's chat_template). The test renders each with jinja2 as the reference, so only the
sources are stored. Qwen3's and Gemma 2's are also in the npm tokenizer packages scripts/test.sh unpacks; the
test checks those copies equal these.
"""
from __future__ import annotations

import json
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "golden" / "chat_templates_families.json"
PACKAGE = "llama-cpp-python==0.3.36"
TEMPLATES = {   # name -> (file under vendor/llama.cpp/models/templates/, model)
    "qwen2.5": ("Qwen-Qwen2.5-7B-Instruct.jinja", "Qwen/Qwen2.5-7B-Instruct"),
    "qwen3": ("Qwen-Qwen3-0.6B.jinja", "Qwen/Qwen3-0.6B"),
    "phi3.5": ("microsoft-Phi-3.5-mini-instruct.jinja", "microsoft/Phi-3.5-mini-instruct"),
    "gemma2": ("google-gemma-2-2b-it.jinja", "google/gemma-2-2b-it"),
}


def main() -> int:
    cache = ROOT / ".cache" / "golden-sources"
    cache.mkdir(parents=True, exist_ok=True)
    sdist = cache / "llama_cpp_python-0.3.36.tar.gz"
    if not sdist.is_file():
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                        PACKAGE, "-d", str(cache)], check=True)
    out = {"note": "published chat templates; tests/test_chat_families.py renders them with jinja2 (the reference) "
                   "and with pyengine's jinja-free twins", "templates": {}}
    with tarfile.open(sdist) as tar:
        root = "llama_cpp_python-0.3.36/vendor/llama.cpp/models/templates/"
        for name, (file, model) in TEMPLATES.items():
            source = tar.extractfile(root + file).read().decode("utf-8")
            out["templates"][name] = {"source": source, "origin": {
                "package": f"{PACKAGE} (sdist)", "file": "vendor/llama.cpp/models/templates/" + file, "model": model}}
    OUT.write_text(json.dumps(out, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
