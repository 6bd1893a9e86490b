"""S03: what an architecture module (models/<arch>.py, found through the registry in models/__init__.py) provides."""
from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class ArchitectureModule(Protocol):
    """``ARCH``: its ``general.architecture``; ``read_config(gguf)`` -> its ModelConfig (plus its own keys);
    ``build(gguf, mode)`` -> (config, weights, model) with weights in ``mode`` ("resident" or "lean") and the model a
    `TransformerModel` (models/base.py: ``forward(plan, kv, buffers)``, ``embed``, ``run_layers``, ``logits``)."""
    ARCH: str

    def read_config(self, gguf): ...

    def build(self, gguf, mode: str = "resident") -> tuple: ...
