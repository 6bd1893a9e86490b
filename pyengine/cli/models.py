"""`pyengine models`: the models this machine has (packaged, pulled from the hub or a URL, GGUFs in this folder),
with size, architecture and quantization; any NAME shown works as `--model NAME`."""
from __future__ import annotations

import argparse
import json
import os
from collections import Counter

from pyengine.model_files import list_models


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="one JSON object per model instead of a table")


def describe_file(path: str) -> dict:
    """Size, architecture and main quant type of a GGUF (the type holding most of the weights' bytes)."""
    from pyengine.gguf.quants import type_name
    from pyengine.gguf.reader import GGUFFile
    size = os.path.getsize(path)
    try:
        g = GGUFFile(path)
    except (ValueError, OSError) as e:
        return {"size": size, "arch": "?", "quant": "?", "error": str(e)}
    weight_bytes: Counter = Counter()
    for t in g.tensors.values():
        if len(t.shape) >= 2:
            weight_bytes[type_name(t.ggml_type)] += t.nbytes
    quant = weight_bytes.most_common(1)[0][0] if weight_bytes else "?"
    return {"size": size, "arch": str(g.get("general.architecture", "?")), "quant": quant}


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def run(args) -> int:
    rows = []
    for m in list_models():
        rows.append({"name": m.name, "source": m.source, "path": m.path, "origin": m.origin,
                     **describe_file(m.path)})
    if args.json:
        for r in rows:
            print(json.dumps(r))
        return 0
    if not rows:
        print("no models here: `pyengine pull org/repo/file.gguf` fetches one")
        return 0
    head = ("NAME", "SIZE", "ARCH", "QUANT", "SOURCE")
    table = [head] + [(r["name"], _size(r["size"]), r["arch"], r["quant"], r["source"]) for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    for row in table:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
    return 0
