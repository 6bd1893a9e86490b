"""S21: malformed GGUF input always raises GGUFError with a reason naming what is wrong -- never IndexError,
struct.error, MemoryError, UnicodeDecodeError, OverflowError or a hang.

Files are built byte by byte here (the gguf package's writer refuses to write broken files); the builder
itself is checked against the gguf package's reader on a well-formed file.
"""
from __future__ import annotations

import struct

import numpy as np
import pytest

from pyengine.gguf import GGUFError
from pyengine.gguf.reader import GGUFFile

U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 = range(13)
Q4_0, F32_T = 2, 0


def gstr(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def kv(key: str | bytes, vtype: int, payload: bytes) -> bytes:
    return gstr(key) + struct.pack("<I", vtype) + payload


def array(etype: int, items: list[bytes], count: int | None = None) -> bytes:
    return struct.pack("<IQ", etype, len(items) if count is None else count) + b"".join(items)


def tinfo(name: str, ne: list[int], ggml_type: int, offset: int) -> bytes:
    return gstr(name) + struct.pack("<I", len(ne)) + b"".join(struct.pack("<Q", d) for d in ne) + \
        struct.pack("<IQ", ggml_type, offset)


def build(kvs: list[bytes] = (), infos: list[bytes] = (), data: bytes = b"", version: int = 3,
          n_kv: int | None = None, n_tensors: int | None = None, alignment: int = 32, pad: bool = True) -> bytes:
    head = b"GGUF" + struct.pack("<IQQ", version, len(infos) if n_tensors is None else n_tensors,
                                 len(kvs) if n_kv is None else n_kv)
    body = head + b"".join(kvs) + b"".join(infos)
    if pad:
        body += b"\0" * (-len(body) % alignment)
    return body + data


def good_file() -> bytes:
    kvs = [kv("general.architecture", STRING, gstr("llama")), kv("x.count", U32, struct.pack("<I", 7)),
           kv("x.list", ARRAY, array(STRING, [gstr("a"), gstr("bc")]))]
    w = np.arange(64, dtype=np.float32)
    infos = [tinfo("a", [32, 2], F32_T, 0), tinfo("b", [32], F32_T, 256)]
    data = w.tobytes() + w[:32].tobytes()
    return build(kvs, infos, data)


def test_builder_is_valid_gguf(tmp_path):
    import gguf
    raw = good_file()
    (tmp_path / "good.gguf").write_bytes(raw)
    ref = gguf.GGUFReader(tmp_path / "good.gguf")
    ours = GGUFFile(raw)
    assert [t.name for t in ref.tensors] == list(ours.tensors)
    assert ours.metadata == {"general.architecture": "llama", "x.count": 7, "x.list": ["a", "bc"]}
    assert [t.data_offset for t in ref.tensors] == [t.offset for t in ours.tensors.values()]
    assert np.array_equal(ours.dequantize("a").ravel(), np.arange(64, dtype=np.float32))


def refuses(data, *patterns: str) -> str:
    with pytest.raises(GGUFError) as info:
        GGUFFile(data)
    message = str(info.value)
    for p in patterns:
        assert p in message, f"{p!r} not in {message!r}"
    return message


def test_not_gguf_and_empty():
    refuses(b"", "not a GGUF file")
    refuses(b"GGU", "not a GGUF file")
    refuses(b"PK\x03\x04" + b"\0" * 100, "not a GGUF file")
    refuses(bytearray(b"\x89PNG\r\n\x1a\n"), "not a GGUF file")
    refuses(np.zeros(0, np.uint8), "not a GGUF file")


def test_versions():
    refuses(build(version=1), "version 1 is unsupported")
    refuses(build(version=0), "version 0 is unsupported")
    refuses(build(version=4), "version 4 is unsupported")
    refuses(b"GGUF" + struct.pack(">IQQ", 3, 0, 0), "big-endian")
    assert GGUFFile(build(version=2)).version == 2


def test_truncated_header():
    refuses(b"GGUF\x03\x00", "GGUF version", "truncated")
    refuses(b"GGUF" + struct.pack("<IQ", 3, 0) + b"\0\0", "key/value count", "truncated")


def test_absurd_counts():
    refuses(build(n_tensors=2**60), "tensor count is 1152921504606846976")
    refuses(build(n_kv=2**60), "metadata key/value count")
    refuses(build(n_kv=2**64 - 1), "metadata key/value count")
    refuses(build([kv("k", ARRAY, array(U32, [], count=2**60))]), "'k'", "array length")
    refuses(build([kv("k", ARRAY, array(STRING, [], count=2**40))]), "'k'", "array length")
    refuses(build([kv("k", ARRAY, array(ARRAY, [], count=2**40))]), "'k'", "array length")
    refuses(build([kv("k", ARRAY, array(U8, [b"\1"], count=2))], pad=False), "'k'", "cannot fit")


def test_unknown_value_types():
    refuses(build([kv("odd.key", 13, b"\0" * 8)]), "'odd.key'", "unknown value type 13")
    refuses(build([kv("odd.key", 2**32 - 1, b"\0" * 8)]), "unknown value type 4294967295")
    refuses(build([kv("arr", ARRAY, array(99, [b"\0"]))]), "'arr'", "unknown array element type 99")


def test_strings_past_eof_and_bad_utf8():
    refuses(build([gstr("k")[:8]], pad=False), "key/value count is 1, which cannot fit")
    refuses(build([struct.pack("<Q", 100) + b"x" * 20], pad=False), "metadata key #0", "string of 100 bytes")
    refuses(build([struct.pack("<Q", 2**63) + b"key"]), "metadata key #0", "string of 9223372036854775808 bytes")
    refuses(build([kv("k", STRING, struct.pack("<Q", 1000) + b"abc")]), "'k'", "string of 1000 bytes")
    refuses(build([kv("k", ARRAY, array(STRING, [gstr("ok"), struct.pack("<Q", 99) + b"x"]))]), "'k'[1]")
    refuses(build([kv(b"bad\xff", U8, b"\1")]), "metadata key #0", "invalid UTF-8")
    refuses(build([kv("k", STRING, gstr(b"\xc3\x28"))]), "'k'", "invalid UTF-8")
    refuses(build([kv("k", ARRAY, array(STRING, [gstr("a"), gstr(b"\xe2\x82")]))]), "'k'[1]", "invalid UTF-8")


def test_values_past_eof():
    refuses(build([kv("k", U64, b"\1\2\3")], pad=False), "'k'", "truncated")
    refuses(build([kv("k", ARRAY, array(F32, [b"\0" * 4] * 3, count=3)[:-2])], pad=False), "'k'", "cannot fit")


def test_nesting_and_duplicates():
    deep = array(U8, [b"\1"])
    for _ in range(12):
        deep = array(ARRAY, [deep])
    refuses(build([kv("deep", ARRAY, deep)]), "'deep", "nested deeper")
    refuses(build([kv("k", U8, b"\1"), kv("k", U8, b"\2")]), "duplicate metadata key 'k'")
    w = b"\0" * 128
    refuses(build([], [tinfo("t", [32], F32_T, 0), tinfo("t", [32], F32_T, 128)], w * 2),
            "duplicate tensor name 't'")


def test_alignment():
    def with_alignment(vtype: int, payload: bytes) -> bytes:
        return build([kv("general.alignment", vtype, payload)], [tinfo("t", [8], F32_T, 0)], b"\0" * 32)
    refuses(with_alignment(U32, struct.pack("<I", 33)), "general.alignment", "power of two")
    refuses(with_alignment(U32, struct.pack("<I", 0)), "general.alignment")
    refuses(with_alignment(STRING, gstr("32")), "general.alignment", "uint32")
    g = GGUFFile(build([kv("general.alignment", U32, struct.pack("<I", 64))], [tinfo("t", [8], F32_T, 0)],
                       b"\0" * 32, alignment=64))
    assert g.alignment == 64 and g.tensor("t").offset % 64 == 0


def test_bad_tensor_infos():
    data = b"\0" * 1024
    refuses(build([], [tinfo("t5", [1, 1, 1, 1, 32], F32_T, 0)], data), "'t5'", "n_dims = 5")
    refuses(build([], [tinfo("t0", [], F32_T, 0)], data), "'t0'", "n_dims = 0")
    refuses(build([], [tinfo("z", [32, 0], F32_T, 0)], data), "'z'", "size 0")
    refuses(build([], [tinfo("big", [2**32, 2**32, 2**32], F32_T, 0)], data), "'big'", "overflows")
    refuses(build([], [tinfo("huge", [2**40, 2**20], F32_T, 0)], data), "'huge'", "past the end")
    refuses(build([], [tinfo("u", [32], 99, 0)], data), "'u'", "unknown ggml type 99")
    refuses(build([], [tinfo("r", [16, 4], Q4_0, 0)], data), "'r'", "not a multiple of the Q4_0 block size 32")
    refuses(build([], [tinfo("eof", [512], F32_T, 0)], data), "'eof'", "past the end")
    refuses(build([], [tinfo("eof", [8], F32_T, 2**64 - 32)], data), "'eof'", "past the end")
    refuses(build([], [tinfo("m", [8], F32_T, 4)], data), "'m'", "not a multiple of the alignment 32")
    refuses(build([], [tinfo("a", [64], F32_T, 0), tinfo("b", [8], F32_T, 128)], data),
            "'a'", "'b'", "overlap")
    refuses(build([], [tinfo("t", [8], F32_T, 0)], data)[:-1000], "'t'", "past the end")
    refuses(build([], [tinfo("t", [8], F32_T, 0)])[:-3], "'t'")
    # tensor infos cut in the middle
    refuses(build([], [tinfo("cut", [8, 8], F32_T, 0)[:-5]], pad=False), "'cut'", "truncated")


def test_every_truncation_of_a_small_file():
    """Each prefix of a valid file is refused with GGUFError (the full file loads)."""
    raw = good_file()
    assert len(GGUFFile(raw).tensors) == 2
    for n in range(len(raw)):
        with pytest.raises(GGUFError):
            GGUFFile(raw[:n])
