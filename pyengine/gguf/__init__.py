"""S21: the GGUF file format (reader) and S08: its quantization formats.

``GGUFError`` lives here so that the reader and the quant kernels share one exception type without
importing each other; everything else is imported on first use.
"""
from __future__ import annotations

from pyengine._lazy import lazy_getattr


class GGUFError(ValueError):
    """A malformed or unsupported GGUF file / tensor, with a reason naming the key, tensor or type."""


_EXPORTS = {
    "GGUFFile": "pyengine.gguf.reader",
    "TensorInfo": "pyengine.gguf.reader",
    "GGMLType": "pyengine.gguf.quants",
    "GGML_BLOCK": "pyengine.gguf.quants",
    "dequantize": "pyengine.gguf.quants",
    "quantize_q8_0": "pyengine.gguf.quants",
    "quantize_q4_0": "pyengine.gguf.quants",
}

__all__ = ["GGUFError", *sorted(_EXPORTS)]


__getattr__ = lazy_getattr(__name__, _EXPORTS, globals())
