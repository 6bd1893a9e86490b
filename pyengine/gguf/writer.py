"""S08/S21: a minimal GGUF writer -- the reader's layout (see ``reader.py``) in the other direction.

    magic "GGUF" | version 3 | tensor_count u64 | kv_count u64 | key/values | tensor infos | padding | data

Metadata values keep their GGUF types: ``metadata_types`` (the reader's ``GGUFFile.metadata_types``) gives
each top-level key's type id; array element types follow from the values (a NumPy array's dtype, a list of
str). Without a type id a value is written as bool, int64 (int), float32 (float), string or array. Tensor
data is written one tensor at a time (each at a multiple of the alignment), so a whole model never needs to
be in memory twice: a tensor's data may be a zero-argument callable that produces its bytes when its turn
comes.
"""
from __future__ import annotations

import struct
from typing import Any, BinaryIO, Callable, NamedTuple

import numpy as np

from pyengine.gguf import GGUFError
from pyengine.gguf import quants

GGUF_VERSION = 3
DEFAULT_ALIGNMENT = 32
# GGUF value type ids (reader.VALUE_TYPES) by NumPy dtype of a numeric array's elements
_DTYPE_TYPE = {np.dtype("u1"): 0, np.dtype("i1"): 1, np.dtype("u2"): 2, np.dtype("i2"): 3, np.dtype("u4"): 4,
               np.dtype("i4"): 5, np.dtype("f4"): 6, np.dtype("bool"): 7, np.dtype("u8"): 10, np.dtype("i8"): 11,
               np.dtype("f8"): 12}
_SCALAR_FMT = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
               12: "<d"}
_STRING, _ARRAY = 8, 9


class TensorOut(NamedTuple):
    name: str
    shape: tuple[int, ...]        # NumPy order (the reader's TensorInfo.shape)
    ggml_type: int
    data: np.ndarray | bytes | Callable[[], np.ndarray | bytes]   # raw bytes, or a producer of them


def _string(s: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def _value_type(value: Any) -> int:
    if isinstance(value, bool):
        return 7
    if isinstance(value, int):
        return 11
    if isinstance(value, float):
        return 6
    if isinstance(value, str):
        return _STRING
    if isinstance(value, (list, tuple, np.ndarray)):
        return _ARRAY
    raise GGUFError(f"cannot write a metadata value of type {type(value).__name__}")


def _array(value, key: str) -> bytes:
    if isinstance(value, np.ndarray):
        etype = _DTYPE_TYPE.get(value.dtype.newbyteorder("=") if value.dtype.byteorder == ">" else value.dtype)
        if etype is None or value.ndim != 1:
            raise GGUFError(f"metadata key {key!r}: cannot write an array of {value.dtype} with shape {value.shape}")
        data = value.astype(value.dtype.newbyteorder("<")).tobytes()
        return struct.pack("<IQ", etype, len(value)) + data
    items = list(value)
    etype = _value_type(items[0]) if items else _STRING
    out = [struct.pack("<IQ", etype, len(items))]
    for i, item in enumerate(items):
        if _value_type(item) != etype:
            raise GGUFError(f"metadata key {key!r}: mixed element types in an array (item {i})")
        out.append(_encode(item, etype, f"{key}[{i}]"))
    return b"".join(out)


def _encode(value: Any, vtype: int, key: str) -> bytes:
    if vtype == _STRING:
        if not isinstance(value, str):
            raise GGUFError(f"metadata key {key!r}: expected a string, got {type(value).__name__}")
        return _string(value)
    if vtype == _ARRAY:
        return _array(value, key)
    fmt = _SCALAR_FMT.get(vtype)
    if fmt is None:
        raise GGUFError(f"metadata key {key!r}: unknown value type {vtype}")
    try:
        return struct.pack(fmt, value)
    except struct.error as exc:
        raise GGUFError(f"metadata key {key!r}: {value!r} does not fit its type ({exc})") from None


def _raw(t: TensorOut) -> np.ndarray:
    data = t.data() if callable(t.data) else t.data
    raw = np.frombuffer(data, np.uint8) if isinstance(data, (bytes, bytearray)) else np.asarray(data)
    if raw.dtype != np.uint8:
        raise GGUFError(f"tensor {t.name!r}: data must be raw uint8 bytes, got {raw.dtype}")
    return raw.reshape(-1)


def write_gguf(f: BinaryIO, metadata: dict[str, Any], tensors: list[TensorOut],
               metadata_types: dict[str, int] | None = None) -> int:
    """Write a GGUF v3 file to the binary stream ``f``; returns the bytes written."""
    types = metadata_types or {}
    alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
    if alignment <= 0 or alignment & (alignment - 1):
        raise GGUFError(f"general.alignment = {alignment} is not a power of two")
    head = [b"GGUF", struct.pack("<IQQ", GGUF_VERSION, len(tensors), len(metadata))]
    for key, value in metadata.items():
        vtype = types.get(key, _value_type(value))
        if key == "general.alignment":
            vtype = 4
        head += [_string(key), struct.pack("<I", vtype), _encode(value, vtype, key)]
    offset, sizes, names = 0, [], set()
    for t in tensors:
        if t.name in names:
            raise GGUFError(f"duplicate tensor name {t.name!r}")
        names.add(t.name)
        nbytes = quants.tensor_nbytes(t.ggml_type, t.shape)
        head += [_string(t.name), struct.pack("<I", len(t.shape)),
                 struct.pack(f"<{len(t.shape)}Q", *reversed(t.shape)), struct.pack("<IQ", t.ggml_type, offset)]
        sizes.append(nbytes)
        offset += -(-nbytes // alignment) * alignment
    header = b"".join(head)
    f.write(header)
    written = len(header)
    pad = -written % alignment
    f.write(b"\0" * pad)
    written += pad
    for t, nbytes in zip(tensors, sizes):
        raw = _raw(t)
        if raw.size != nbytes:
            raise GGUFError(f"tensor {t.name!r}: {quants.type_name(t.ggml_type)} of shape {t.shape} needs "
                            f"{nbytes} bytes, got {raw.size}")
        f.write(raw.tobytes())
        pad = -nbytes % alignment
        f.write(b"\0" * pad)
        written += nbytes + pad
    return written
