"""Split GGUF files (llama.cpp's gguf-split layout), the way models larger than one file ship.

A model split in N parts is N complete GGUF files named ``<prefix>-00001-of-0000N.gguf`` ...
``<prefix>-0000N-of-0000N.gguf``. Every part carries three keys:

    split.no             uint16   0-based index of this part
    split.count          uint16   N
    split.tensors.count  int32    tensors in the whole model (all parts)

The first part holds all the metadata (and usually some tensors); each part lists only its own tensors,
with offsets into its own data section. ``GGUFFile(first part)`` opens the others (``reader.py``).
``write_split`` writes such a copy of a model (tests, and ``split_gguf`` for users with a size limit such as
the browser's 2 GB ArrayBuffer).
"""
from __future__ import annotations

import os
import re

from pyengine.gguf import GGUFError
from pyengine.gguf.writer import TensorOut, write_gguf

__all__ = ["SPLIT_NO", "SPLIT_COUNT", "SPLIT_TENSORS", "part_name", "part_paths", "write_split"]

SPLIT_NO, SPLIT_COUNT, SPLIT_TENSORS = "split.no", "split.count", "split.tensors.count"
_UINT16, _INT32 = 2, 5
_NAME = re.compile(r"^(?P<prefix>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


def part_name(prefix: str, no: int, count: int) -> str:
    """llama.cpp's file name of part ``no`` (0-based) of ``count``."""
    return f"{prefix}-{no + 1:05d}-of-{count:05d}.gguf"


def part_paths(first: str, count: int) -> list[str]:
    """The paths of all ``count`` parts, given the first one's (which must follow the naming)."""
    m = _NAME.match(os.fspath(first))
    if m is None or int(m["no"]) != 1:
        raise GGUFError(f"{first}: a split GGUF ({SPLIT_COUNT} = {count}) must be opened by its first part, "
                        f"named <prefix>-00001-of-{count:05d}.gguf")
    if int(m["count"]) != count:
        raise GGUFError(f"{first}: the file name says {int(m['count'])} parts but {SPLIT_COUNT} = {count}")
    return [part_name(m["prefix"], i, count) for i in range(count)]


def write_split(g, prefix: str, max_tensors: int) -> list[str]:
    """Write the opened model ``g`` (a GGUFFile) as parts of at most ``max_tensors`` tensors each, the first part
    carrying all the metadata. Returns the paths written."""
    if max_tensors < 1:
        raise ValueError(f"max_tensors must be >= 1, got {max_tensors}")
    infos = list(g.tensors.values())
    groups = [infos[i:i + max_tensors] for i in range(0, len(infos), max_tensors)] or [[]]
    count = len(groups)
    paths = []
    for no, group in enumerate(groups):
        split_md = {SPLIT_NO: no, SPLIT_COUNT: count, SPLIT_TENSORS: len(infos)}
        split_types = {SPLIT_NO: _UINT16, SPLIT_COUNT: _UINT16, SPLIT_TENSORS: _INT32}
        if no == 0:
            md = {k: v for k, v in g.metadata.items() if not k.startswith("split.")}
            types = {k: v for k, v in g.metadata_types.items() if k in md}
        else:
            md, types = {}, {}
            if "general.alignment" in g.metadata:
                md["general.alignment"] = g.metadata["general.alignment"]
        md.update(split_md)
        types.update(split_types)
        path = part_name(prefix, no, count)
        with open(path, "wb") as f:
            write_gguf(f, md, [TensorOut(t.name, t.shape, t.ggml_type, t.data) for t in group], types)
        paths.append(path)
    return paths
