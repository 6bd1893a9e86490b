"""S21: a GGUF reader (picoLM-style): header, metadata, tensor infos, and zero-copy tensor data.

File layout (all little-endian):
    magic "GGUF" | version u32 | tensor_count u64 | kv_count u64
    kv_count x (key: string, value_type: u32, value)          string = u64 length + UTF-8 bytes
    tensor_count x (name: string, n_dims: u32, ne: u64[n_dims], ggml_type: u32, offset: u64)
    padding to `general.alignment` (default 32) | tensor data (each tensor at data_start + offset)

The file is untrusted input: every count and length is checked against the bytes that remain *before*
anything is allocated or looped over, and every problem is a ``GGUFError`` naming the key, tensor or type.
"""
from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pyengine.gguf import GGUFError
from pyengine.gguf import quants
from pyengine.gguf.split import SPLIT_COUNT, SPLIT_NO, SPLIT_TENSORS, part_paths

__all__ = ["GGUFError", "GGUFFile", "TensorInfo"]

MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4              # GGML_MAX_DIMS
MAX_ARRAY_NESTING = 8     # arrays of arrays deeper than this are refused (no recursion bombs)

# GGUF metadata value types: id -> (name, little-endian NumPy dtype or None for string/array)
VALUE_TYPES: dict[int, tuple[str, str | None]] = {
    0: ("uint8", "<u1"), 1: ("int8", "<i1"), 2: ("uint16", "<u2"), 3: ("int16", "<i2"),
    4: ("uint32", "<u4"), 5: ("int32", "<i4"), 6: ("float32", "<f4"), 7: ("bool", "<u1"),
    8: ("string", None), 9: ("array", None), 10: ("uint64", "<u8"), 11: ("int64", "<i8"),
    12: ("float64", "<f8"),
}
_STRING, _ARRAY, _BOOL = 8, 9, 7
# Smallest encoding of one value of each type: bounds an array's count by the bytes left.
_MIN_SIZE = {t: (np.dtype(dt).itemsize if dt else (8 if t == _STRING else 12)) for t, (_, dt) in VALUE_TYPES.items()}


@dataclass
class TensorInfo:
    name: str
    shape: tuple[int, ...]   # NumPy order = reversed GGUF ne; a weight [out, in] has ne=(in, out)
    ggml_type: int
    offset: int              # absolute byte offset in the file/buffer
    nbytes: int
    data: np.ndarray = field(repr=False)  # uint8 zero-copy view of the raw bytes

    @property
    def type_name(self) -> str:
        return quants.type_name(self.ggml_type)

    @property
    def n_elements(self) -> int:
        return math.prod(self.shape)


def _as_uint8(source) -> np.ndarray:
    """The whole file as a 1-D uint8 array without copying: memory-mapped for a path, a view otherwise."""
    if isinstance(source, (str, os.PathLike)):
        if os.path.getsize(source) == 0:   # np.memmap refuses empty files; report it as a GGUF problem
            raise GGUFError(f"{os.fspath(source)}: empty file, not a GGUF file")
        try:
            return np.memmap(source, dtype=np.uint8, mode="r")
        except (ImportError, OSError) as exc:   # no mmap (e.g. some WebAssembly builds): read it instead
            if isinstance(exc, (FileNotFoundError, IsADirectoryError, PermissionError)):
                raise
            with open(source, "rb") as f:
                return np.frombuffer(f.read(), dtype=np.uint8)
    if isinstance(source, np.ndarray):
        if not source.flags.c_contiguous:
            raise GGUFError("GGUF source array must be C-contiguous")
        return source.reshape(-1).view(np.uint8)
    if isinstance(source, (bytes, bytearray, memoryview)):
        mv = memoryview(source)
        if not mv.c_contiguous:
            raise GGUFError("GGUF source buffer must be C-contiguous")
        return np.frombuffer(mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv, dtype=np.uint8)
    raise TypeError(f"GGUF source must be a path, bytes, bytearray, memoryview or numpy array, "
                    f"not {type(source).__name__}")


_U64 = struct.Struct("<Q")


class _Cursor:
    """Sequential little-endian reads over a buffer; each read checks the bytes that remain first."""

    def __init__(self, buf: np.ndarray):
        self.buf = buf
        self.mv = memoryview(buf)
        self.size = buf.size
        self.pos = 0

    def remaining(self) -> int:
        return self.size - self.pos

    def need(self, n: int, what: str) -> None:
        if n > self.size - self.pos:
            raise GGUFError(f"{what}: needs {n} bytes at offset {self.pos} but the file has only "
                            f"{self.size - self.pos} left (truncated or corrupt)")

    def unpack(self, fmt: str, size: int, what: str):
        self.need(size, what)
        value = struct.unpack_from(fmt, self.mv, self.pos)[0]
        self.pos += size
        return value

    def u32(self, what: str) -> int:
        return self.unpack("<I", 4, what)

    def u64(self, what: str) -> int:
        return self.unpack("<Q", 8, what)

    def string(self, what: str) -> str:
        n = self.u64(f"{what} (string length)")
        self.need(n, f"{what} (string of {n} bytes)")
        raw = self.mv[self.pos:self.pos + n]
        self.pos += n
        try:
            return str(raw, "utf-8")
        except UnicodeDecodeError as exc:
            raise GGUFError(f"{what}: invalid UTF-8 in string ({exc.reason} at byte {exc.start})") from None

    def strings(self, n: int, what: str) -> list[str]:
        """n strings in a row (token lists: ~10^5 of them), in a tight loop with the same checks as string()."""
        mv, pos, size = self.mv, self.pos, self.size
        unpack = _U64.unpack_from
        out = [""] * n
        try:
            for i in range(n):
                if pos + 8 > size:
                    self.pos = pos
                    self.need(8, f"{what}[{i}] (string length)")
                (length,) = unpack(mv, pos)
                pos += 8
                end = pos + length
                if end > size:
                    self.pos = pos
                    self.need(length, f"{what}[{i}] (string of {length} bytes)")
                out[i] = str(mv[pos:end], "utf-8")
                pos = end
        except UnicodeDecodeError as exc:
            raise GGUFError(f"{what}[{i}]: invalid UTF-8 in string ({exc.reason} at byte {exc.start})") from None
        self.pos = pos
        return out

    def count(self, what: str, min_item_size: int) -> int:
        """A u64 element count, refused if even the smallest items could not fit in the bytes left."""
        n = self.u64(what)
        if n * min_item_size > self.remaining():
            raise GGUFError(f"{what} is {n}, which cannot fit in the {self.remaining()} bytes left")
        return n

    def numbers(self, dtype: str, n: int, what: str) -> np.ndarray:
        dt = np.dtype(dtype)
        self.need(n * dt.itemsize, what)
        # copy: metadata must not change (or pin the file) when the caller reuses the buffer
        arr = np.frombuffer(self.mv, dtype=dt, count=n, offset=self.pos).copy()
        self.pos += n * dt.itemsize
        return arr


def _read_value(cur: _Cursor, vtype: int, key: str, depth: int = 0) -> Any:
    if vtype not in VALUE_TYPES:
        raise GGUFError(f"metadata key {key!r}: unknown value type {vtype}")
    if vtype == _STRING:
        return cur.string(f"metadata key {key!r}")
    if vtype == _ARRAY:
        if depth >= MAX_ARRAY_NESTING:
            raise GGUFError(f"metadata key {key!r}: arrays nested deeper than {MAX_ARRAY_NESTING}")
        etype = cur.u32(f"metadata key {key!r} (array element type)")
        if etype not in VALUE_TYPES:
            raise GGUFError(f"metadata key {key!r}: unknown array element type {etype}")
        n = cur.count(f"metadata key {key!r} (array length)", _MIN_SIZE[etype])
        if etype == _STRING:
            return cur.strings(n, f"metadata key {key!r}")
        if etype == _ARRAY:
            return [_read_value(cur, _ARRAY, f"{key}[{i}]", depth + 1) for i in range(n)]
        arr = cur.numbers(VALUE_TYPES[etype][1], n, f"metadata key {key!r} (array data)")
        return arr != 0 if etype == _BOOL else arr
    value = cur.numbers(VALUE_TYPES[vtype][1], 1, f"metadata key {key!r}")[0]
    return bool(value) if vtype == _BOOL else value.item()   # Python int/float


class GGUFFile:
    """A parsed GGUF file. Tensor data stays in the source buffer (mmap for a path): nothing is copied.

    A split model (``split.count`` > 1, see ``split.py``) is opened by its first part: the other parts are
    found next to it by name (or given as ``parts``, e.g. buffers in a browser) and their tensors join
    ``tensors``; a missing or mismatched part is a ``GGUFError`` naming it. ``part_sizes`` lists each
    part's bytes (one entry for an ordinary file)."""

    def __init__(self, source, parts=None, *, _as_part: bool = False):
        self.path = os.fspath(source) if isinstance(source, (str, os.PathLike)) else None
        self.buffer = _as_uint8(source)
        self.file_size = int(self.buffer.size)
        cur = _Cursor(self.buffer)
        self._read_header(cur)
        self._read_metadata(cur)
        self._read_tensor_infos(cur)
        self.part_sizes = [self.file_size]
        if not _as_part:
            self._join_parts(parts)

    # -- split files ---------------------------------------------------------------------------------------
    def _split_keys(self, what: str) -> tuple[int, int] | None:
        if SPLIT_COUNT not in self.metadata:
            return None
        no, count = self.metadata.get(SPLIT_NO), self.metadata[SPLIT_COUNT]
        if not isinstance(count, int) or not isinstance(no, int) or count < 1 or not 0 <= no < count:
            raise GGUFError(f"{what}: bad split keys ({SPLIT_NO} = {no!r}, {SPLIT_COUNT} = {count!r})")
        return no, count

    def _join_parts(self, parts) -> None:
        me = self.path or "GGUF buffer"
        keys = self._split_keys(me)
        if keys is None or keys[1] == 1:
            if parts:
                raise GGUFError(f"{me}: extra parts given, but this file is not split")
            return
        no, count = keys
        if no != 0:
            raise GGUFError(f"{me} is part {no + 1} of {count} of a split GGUF: open the first part")
        if parts is None:
            if self.path is None:
                raise GGUFError(f"this GGUF buffer is part 1 of {count}: pass the other parts (parts=[...])")
            names = part_paths(self.path, count)[1:]
            for name in names:
                if not os.path.isfile(name):
                    raise GGUFError(f"split GGUF {self.path}: part {name} is missing")
            parts = names
        parts = list(parts)
        if len(parts) != count - 1:
            raise GGUFError(f"{me}: split.count = {count} needs {count - 1} more parts, got {len(parts)}")
        for i, src in enumerate(parts, start=1):
            label = os.fspath(src) if isinstance(src, (str, os.PathLike)) else f"part {i + 1} of {count}"
            try:
                part = GGUFFile(src, _as_part=True)
            except GGUFError as exc:
                raise GGUFError(f"split GGUF part {label}: {exc}") from None
            pk = part._split_keys(label)
            if pk != (i, count):
                raise GGUFError(f"split GGUF part {label} does not belong here: expected part {i + 1} of {count}, "
                                f"it says " + (f"part {pk[0] + 1} of {pk[1]}" if pk else "it is not split"))
            for name, info in part.tensors.items():
                if name in self.tensors:
                    raise GGUFError(f"split GGUF part {label}: tensor {name!r} is also in an earlier part")
                self.tensors[name] = info
            self.part_sizes.append(part.file_size)
        want = self.metadata.get(SPLIT_TENSORS)
        if want is not None and want != len(self.tensors):
            raise GGUFError(f"{me}: {SPLIT_TENSORS} = {want} but the {count} parts hold {len(self.tensors)} tensors")

    # -- header ------------------------------------------------------------------------------------------
    def _read_header(self, cur: _Cursor) -> None:
        if self.file_size < 4 or bytes(cur.mv[:4]) != MAGIC:
            head = bytes(cur.mv[:4])
            raise GGUFError(f"not a GGUF file (magic {head!r}, expected {MAGIC!r})")
        cur.pos = 4
        version = cur.u32("GGUF version")
        if version not in SUPPORTED_VERSIONS:
            if version == 1:
                raise GGUFError("GGUF version 1 is unsupported (32-bit counts; re-convert the model)")
            if int.from_bytes(version.to_bytes(4, "little"), "big") in SUPPORTED_VERSIONS:
                raise GGUFError("big-endian GGUF files are unsupported")
            raise GGUFError(f"GGUF version {version} is unsupported (supported: 2, 3)")
        self.version = version
        # smallest tensor info: empty name (8) + n_dims (4) + one dim (8) + type (4) + offset (8)
        self._n_tensors = cur.count("tensor count", 32)
        # smallest key/value: empty key (8) + type (4) + a 1-byte value
        self._n_kv = cur.count("metadata key/value count", 13)
        if self._n_tensors * 32 + self._n_kv * 13 > cur.remaining():
            raise GGUFError(f"{self._n_tensors} tensors and {self._n_kv} metadata keys cannot fit in "
                            f"{cur.remaining()} bytes")

    # -- metadata ----------------------------------------------------------------------------------------
    def _read_metadata(self, cur: _Cursor) -> None:
        self.metadata: dict[str, Any] = {}
        self.metadata_types: dict[str, int] = {}
        for i in range(self._n_kv):
            key = cur.string(f"metadata key #{i}")
            if key in self.metadata:
                raise GGUFError(f"duplicate metadata key {key!r}")
            vtype = cur.u32(f"metadata key {key!r} (value type)")
            self.metadata[key] = _read_value(cur, vtype, key)
            self.metadata_types[key] = vtype
        alignment = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if "general.alignment" in self.metadata and self.metadata_types["general.alignment"] != 4:
            raise GGUFError("metadata key 'general.alignment' must be a uint32")
        if alignment <= 0 or alignment & (alignment - 1):
            raise GGUFError(f"metadata key 'general.alignment' = {alignment} is not a power of two")
        self.alignment = int(alignment)

    # -- tensor infos ------------------------------------------------------------------------------------
    def _read_tensor_infos(self, cur: _Cursor) -> None:
        raw_infos = []
        names = set()
        for i in range(self._n_tensors):
            name = cur.string(f"tensor #{i} name")
            if name in names:
                raise GGUFError(f"duplicate tensor name {name!r}")
            names.add(name)
            n_dims = cur.u32(f"tensor {name!r} (n_dims)")
            if not 1 <= n_dims <= MAX_DIMS:
                raise GGUFError(f"tensor {name!r}: n_dims = {n_dims}, must be 1..{MAX_DIMS}")
            ne = [cur.u64(f"tensor {name!r} (dimension {d})") for d in range(n_dims)]
            ggml_type = cur.u32(f"tensor {name!r} (ggml type)")
            offset = cur.u64(f"tensor {name!r} (data offset)")
            raw_infos.append((name, ne, ggml_type, offset))

        # Tensor data starts at the next multiple of the alignment after the infos.
        data_start = -(-cur.pos // self.alignment) * self.alignment
        self._plain = self.buffer.view(np.ndarray)   # tensor views as plain arrays (still backed by the mmap)
        self.data_offset = data_start
        self.tensors: dict[str, TensorInfo] = {}
        for name, ne, ggml_type, offset in raw_infos:
            if any(d == 0 for d in ne):
                raise GGUFError(f"tensor {name!r}: dimension of size 0 in {tuple(ne)}")
            n_elements = math.prod(ne)
            if n_elements >= 2**63:
                raise GGUFError(f"tensor {name!r}: element count of shape {tuple(ne)} overflows int64")
            try:
                layout = quants.block_layout(ggml_type)
            except GGUFError:
                raise GGUFError(f"tensor {name!r}: unknown ggml type {ggml_type}") from None
            if ne[0] % layout.block_size:
                raise GGUFError(f"tensor {name!r}: row length {ne[0]} is not a multiple of the "
                                f"{quants.type_name(ggml_type)} block size {layout.block_size}")
            nbytes = n_elements // layout.block_size * layout.type_size
            if offset % self.alignment:
                raise GGUFError(f"tensor {name!r}: data offset {offset} is not a multiple of the "
                                f"alignment {self.alignment}")
            start = data_start + offset
            if start + nbytes > self.file_size:
                raise GGUFError(f"tensor {name!r}: data [{start}, {start + nbytes}) runs past the end of the "
                                f"file ({self.file_size} bytes)")
            self.tensors[name] = TensorInfo(name=name, shape=tuple(int(d) for d in reversed(ne)),
                                            ggml_type=ggml_type, offset=start, nbytes=nbytes,
                                            data=self._plain[start:start + nbytes])
        # Tensors may be stored in any order but must not share bytes.
        spans = sorted((t.offset, t.offset + t.nbytes, t.name) for t in self.tensors.values())
        for (_, end_a, name_a), (start_b, _, name_b) in zip(spans, spans[1:]):
            if start_b < end_a:
                raise GGUFError(f"tensors {name_a!r} and {name_b!r} overlap in the file")

    # -- access --------------------------------------------------------------------------------------------
    @property
    def architecture(self) -> str | None:
        return self.metadata.get("general.architecture")

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def __contains__(self, key: str) -> bool:
        return key in self.metadata

    def tensor(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise GGUFError(f"tensor {name!r} not found in the GGUF file") from None

    def dequantize(self, name: str) -> np.ndarray:
        """A tensor as a new float32 array of its NumPy-order shape."""
        info = self.tensor(name)
        try:
            return quants.dequantize(info.data, info.ggml_type, info.shape)
        except GGUFError as exc:
            raise GGUFError(f"tensor {name!r}: {exc}") from None

    def __repr__(self) -> str:
        src = self.path or f"<{self.file_size} bytes>"
        return (f"GGUFFile({src!r}, version={self.version}, arch={self.architecture!r}, "
                f"{len(self.metadata)} keys, {len(self.tensors)} tensors)")
