"""pyengine: an LLM inference engine in pure NumPy, readable chapter by chapter (S01-S22).

``import pyengine`` is light: names are imported on first use (PEP 562), so the CLI, server and
browser worker only pay for what they touch.
"""
from __future__ import annotations

from pyengine._lazy import lazy_getattr

__version__ = "0.1.0"

_EXPORTS = {
    "GGUFFile": "pyengine.gguf.reader",
    "GGUFError": "pyengine.gguf.reader",
    "Tokenizer": "pyengine.tokenizer",
    "ModelConfig": "pyengine.config",
    "SamplingParams": "pyengine.sampling_params",
    "StructuredOutputsParams": "pyengine.sampling_params",
    "LLM": "pyengine.llm",
    "LLMEngine": "pyengine.engine.llm_engine",
    "RequestOutput": "pyengine.engine.outputs",
    "CompletionOutput": "pyengine.engine.outputs",
    "default_model_path": "pyengine.model_files",
}

__all__ = sorted(_EXPORTS)


__getattr__ = lazy_getattr(__name__, _EXPORTS, globals())
