"""S05: the arena — one preallocated byte buffer from which all runtime state is carved.

The runner sizes it once from the config and its limits (max_model_len, max_num_batched_tokens, num_blocks):
activations, the paged KV cache, logits and attention scratch are named, aligned views into it. The decode
loop then writes with ``out=`` into these views and creates no model-sized arrays per token; peak memory is
known up front (and in the browser, one large allocation beats thousands of small ones). Weights are not in
the arena: they are read-only and come from the file.
"""
from __future__ import annotations

import math
from typing import Iterable, NamedTuple

import numpy as np

ALIGNMENT = 64          # cache-line aligned views


class ArenaSpec(NamedTuple):
    name: str
    shape: tuple[int, ...]
    dtype: np.dtype


def _aligned(n: int, alignment: int = ALIGNMENT) -> int:
    return -(-n // alignment) * alignment


def spec(name: str, shape, dtype=np.float32) -> ArenaSpec:
    shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(int(s) for s in shape)
    if any(s < 0 for s in shape):
        raise ValueError(f"arena region {name!r}: negative shape {shape}")
    return ArenaSpec(name, shape, np.dtype(dtype))


def plan_nbytes(specs: Iterable[ArenaSpec]) -> int:
    """Bytes an arena needs to hold these regions, with the padding ``alloc`` adds for alignment."""
    return sum(_aligned(math.prod(s.shape) * s.dtype.itemsize) for s in specs) + ALIGNMENT


class Arena:
    """A bump allocator over one np.uint8 buffer. Regions live as long as the arena (no free)."""

    def __init__(self, nbytes: int, buffer=None, zero: bool = True):
        """``buffer``: memory to carve instead of a new allocation (tensor parallelism's shared memory, which
        every process maps and carves alike); ``zero=False`` leaves its contents (a second mapping)."""
        if nbytes < 0:
            raise ValueError(f"arena size must be >= 0, got {nbytes}")
        if buffer is None:
            self.buffer = np.empty(int(nbytes), dtype=np.uint8)
        else:
            self.buffer = np.frombuffer(buffer, dtype=np.uint8, count=int(nbytes))
        # Zeroed by writing, not lazily (np.zeros maps untouched pages): every page is faulted in now, so no
        # step pays page faults when the KV cache reaches blocks never used before (32 sequences: ~3 ms a step).
        if zero:
            self.buffer.fill(0)
        # 16-byte aligned at least; start the first region on a 64-byte boundary.
        self._offset = (-self.buffer.__array_interface__["data"][0]) % ALIGNMENT   # no ctypes (Pyodide)
        self.regions: dict[str, tuple[int, int, tuple[int, ...], np.dtype]] = {}
        self.views: dict[str, np.ndarray] = {}

    @classmethod
    def from_specs(cls, specs: list[ArenaSpec], buffer=None, zero: bool = True) -> "Arena":
        """An arena sized exactly for ``specs``, with every region carved (``arena[name]`` is its view)."""
        arena = cls(plan_nbytes(specs), buffer, zero)
        for s in specs:
            arena.alloc(s.name, s.shape, s.dtype)
        return arena

    @property
    def nbytes(self) -> int:
        return self.buffer.nbytes

    @property
    def used(self) -> int:
        return self._offset

    def alloc(self, name: str, shape, dtype=np.float32) -> np.ndarray:
        """A zero-initialized, 64-byte aligned view of ``shape``; MemoryError naming the region if full."""
        if name in self.regions:
            raise ValueError(f"arena region {name!r} already exists")
        s = spec(name, shape, dtype)
        n = math.prod(s.shape) * s.dtype.itemsize
        start = self._offset
        if start + n > self.buffer.nbytes:
            raise MemoryError(f"arena full: region {name!r} needs {n} bytes, "
                              f"{self.buffer.nbytes - start} of {self.buffer.nbytes} left")
        self._offset = start + _aligned(n)
        self.regions[name] = (start, n, s.shape, s.dtype)
        view = self.buffer[start:start + n].view(s.dtype).reshape(s.shape)
        self.views[name] = view
        return view

    def __getitem__(self, name: str) -> np.ndarray:
        try:
            return self.views[name]
        except KeyError:
            raise KeyError(f"arena has no region {name!r}") from None

    def summary(self) -> str:
        """The carve-up: one line per region, grouped by the prefix before the first '.'."""
        groups: dict[str, int] = {}
        for name, (_, n, _, _) in self.regions.items():
            key = name.split(".", 1)[0]
            groups[key] = groups.get(key, 0) + n
        width = max((len(k) for k in groups), default=5)
        lines = [f"arena {self.nbytes / 2**20:.1f} MiB ({self.used / 2**20:.1f} MiB used)"]
        for key, n in sorted(groups.items(), key=lambda kv: -kv[1]):
            lines.append(f"  {key:<{width}}  {n / 2**20:9.2f} MiB  {100 * n / max(1, self.nbytes):5.1f}%")
        return "\n".join(lines)
