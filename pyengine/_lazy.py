"""PEP 562 lazy exports, shared by the packages that keep ``import`` light (``pyengine``, ``pyengine.gguf``)."""
from __future__ import annotations

import importlib


def lazy_getattr(package: str, exports: dict[str, str], namespace: dict):
    """A module ``__getattr__`` that imports ``exports[name]``'s module on first use and caches the value."""
    def __getattr__(name: str):
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value
    return __getattr__
