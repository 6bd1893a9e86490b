"""S21: seeded fuzzing of the real SmolLM2 GGUF. Every mutated file either loads (and then dequantizing a
tensor works or raises GGUFError) or raises GGUFError -- no other exception, no hang.

One bytearray copy of the file is mutated in place and restored after each case; truncation is a
zero-copy memoryview prefix, so 500 cases cost about one parse each.
"""
from __future__ import annotations

import time
import warnings
from pathlib import Path

import numpy as np
import pytest

from pyengine.gguf import GGUFError
from pyengine.gguf.reader import GGUFFile
from pyengine.model_files import default_model_path

import gguf

N_CASES = 500
MAX_SECONDS_PER_CASE = 5.0   # a parse takes ~0.05 s; anything near this is a hang


@pytest.fixture(scope="module")
def original() -> bytes:
    return Path(default_model_path()).read_bytes()


@pytest.fixture(scope="module")
def int_fields(original) -> dict[str, list[tuple[int, int]]]:
    """(offset, width) of the integer fields that give the file its structure -- counts, lengths, type ids,
    dimensions, offsets -- located by the gguf package's reader, grouped by region."""
    reader = gguf.GGUFReader(default_model_path())
    base = reader.data.__array_interface__["data"][0]
    groups: dict[str, set] = {"header": set(), "metadata": set(), "token strings": set(), "tensor infos": set()}

    def add(group: str, part: np.ndarray, k: int = 0) -> None:
        if part.dtype.kind in "ui" and part.dtype.itemsize in (4, 8):
            width = part.dtype.itemsize
            groups[group].add((part.__array_interface__["data"][0] - base + k * width, width))

    for field in reader.fields.values():
        if field.name.startswith("GGUF."):          # version, tensor count, kv count
            add("header", field.parts[0])
            continue
        many = len(field.parts) > 64                 # tokens / merges: one length per string
        values = set(field.data)
        for i, part in enumerate(field.parts):
            if part.size == 1 and i not in values:
                add("token strings" if many and i > 5 else "metadata", part)
    for t in reader.tensors:
        for part in t.field.parts:
            if part.dtype.kind in "ui" and part.dtype.itemsize in (4, 8):
                for k in range(part.size):           # the dims are one part of n_dims values
                    add("tensor infos", part, k)
    assert len(groups["tensor infos"]) > 272 * 4 and len(groups["header"]) == 3
    assert len(groups["token strings"]) > 49152
    return {name: sorted(fields) for name, fields in groups.items()}


def _bogus(rng: np.random.Generator, width: int, old: int, file_size: int) -> int:
    top = 2 ** (8 * width)
    choices = [0, 1, 2, 3, 5, 13, top - 1, top // 2, top // 2 - 1, old + 1, old - 1, old * 2, old + 32,
               file_size, file_size - 1, 2**32 - 1, 2**31, 2**60, int(rng.integers(0, top, dtype=np.uint64))]
    return choices[rng.integers(len(choices))] % top


def _check_case(data: memoryview, rng: np.random.Generator, outcomes: dict) -> None:
    try:
        g = GGUFFile(data)
    except GGUFError:
        outcomes["refused"] += 1
        return
    outcomes["loaded"] += 1
    small = [t for t in g.tensors.values() if t.nbytes <= 1 << 20]
    for info in (small[rng.integers(len(small))],) if small else ():
        assert info.data.size == info.nbytes and info.offset + info.nbytes <= len(data)
        try:
            x = g.dequantize(info.name)
            assert x.dtype == np.float32 and x.shape == info.shape
            outcomes["dequantized"] += 1
        except GGUFError:
            outcomes["dequant_refused"] += 1


def test_fuzz_real_file(original, int_fields):
    rng = np.random.default_rng(20261129)
    buf = bytearray(original)
    size = len(buf)
    data_start = GGUFFile(original).data_offset
    outcomes = {"loaded": 0, "refused": 0, "dequantized": 0, "dequant_refused": 0}
    kinds = {"flip": 0, "truncate": 0, "field": 0, "field+truncate": 0, "tensor_bytes": 0}
    slowest = 0.0
    for case in range(N_CASES):
        kind = list(kinds)[case % len(kinds)]
        kinds[kind] += 1
        saved: list[tuple[int, bytes]] = []
        length = size
        if kind == "flip":
            # 1-8 random bytes of the header / metadata / tensor-info region
            for _ in range(int(rng.integers(1, 9))):
                pos = int(rng.integers(0, data_start))
                saved.append((pos, bytes(buf[pos:pos + 1])))
                buf[pos] = int(rng.integers(0, 256))
        if kind in ("field", "field+truncate"):
            for _ in range(int(rng.integers(1, 3))):
                group = list(int_fields.values())[rng.integers(len(int_fields))]
                pos, width = group[rng.integers(len(group))]
                old = int.from_bytes(buf[pos:pos + width], "little")
                saved.append((pos, bytes(buf[pos:pos + width])))
                buf[pos:pos + width] = _bogus(rng, width, old, size).to_bytes(width, "little")
        if kind == "tensor_bytes":
            # garbage in tensor data (scales become inf/NaN...): must load; dequantize must not raise
            pos = int(rng.integers(data_start, size - 4096))
            saved.append((pos, bytes(buf[pos:pos + 4096])))
            buf[pos:pos + 4096] = rng.integers(0, 256, 4096, dtype=np.uint8).tobytes()
        if kind in ("truncate", "field+truncate"):
            # half of the cut points inside the metadata / tensor infos, half anywhere
            hi = data_start + 64 if rng.random() < 0.5 else size
            length = int(rng.integers(0, hi))
        t0 = time.perf_counter()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error")      # no RuntimeWarning either (NaN scales are data)
                _check_case(memoryview(buf)[:length], rng, outcomes)
        finally:
            for pos, old in reversed(saved):
                buf[pos:pos + len(old)] = old
        slowest = max(slowest, time.perf_counter() - t0)
        assert slowest < MAX_SECONDS_PER_CASE, f"case {case} ({kind}) took {slowest:.1f}s"
    assert buf == original
    # the campaign must exercise both outcomes, or it tests nothing
    print(outcomes, kinds)
    assert outcomes["loaded"] >= 50 and outcomes["refused"] >= 200, outcomes
    assert outcomes["dequantized"] >= 50, outcomes
