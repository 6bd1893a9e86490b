"""`pyengine bench tokenizer`: encode/decode throughput of the S02 tokenizers on ~1 MB of English.

The text is English prose taken from the docstrings of the Python standard library (deterministic, no
download, also present in Pyodide), so word frequencies are natural and the word cache is exercised
honestly. Printed per model: cold encode (empty word cache), warm encode (cache filled), decode, and
the ratio of cold encode time to the time `re` alone needs to pre-tokenize the same text.
"""
from __future__ import annotations

import importlib
import inspect
import time

HELP = "tokenizer encode/decode throughput on ~1 MB of English text"

_MODULES = ("argparse", "collections", "json", "re", "typing", "pathlib", "functools", "itertools",
            "dataclasses", "textwrap", "string", "datetime", "decimal", "fractions", "statistics", "random",
            "heapq", "bisect", "enum", "inspect", "logging", "unittest", "email", "http.client", "urllib.parse",
            "csv", "sqlite3", "zipfile", "tarfile", "shutil", "os", "subprocess", "threading", "asyncio",
            "difflib", "pickle", "codecs", "io", "tokenize", "ast", "dis", "pdb", "doctest", "calendar")


def english_text(n_bytes: int) -> str:
    """About n_bytes of docstring prose from the standard library (repeated if the library runs out)."""
    docs, seen = [], set()
    for name in _MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        for obj in [module] + [v for _, v in sorted(vars(module).items()) if inspect.isclass(v) or callable(v)]:
            doc = inspect.getdoc(obj)
            if doc and doc not in seen:
                seen.add(doc)
                docs.append(doc)
    if not docs:
        raise RuntimeError("no docstrings found to build the benchmark text")
    parts, size, i = [], 0, 0
    while size < n_bytes:
        doc = docs[i % len(docs)]
        parts.append(doc)
        size += len(doc.encode("utf-8")) + 2
        i += 1
    return "\n\n".join(parts).encode("utf-8")[:n_bytes].decode("utf-8", errors="ignore")


def add_arguments(p) -> None:
    p.add_argument("--model", action="append", default=None,
                   help="GGUF file (repeatable); default: SmolLM2 and, if present, the Gemma 3 file")
    p.add_argument("--mb", type=float, default=1.0, help="megabytes of text (default 1)")
    p.add_argument("--quick", action="store_true", help="50 kB of text (a smoke test)")


def _default_models() -> list[str]:
    import os
    from pathlib import Path

    from ..model_files import default_model_path
    models = [default_model_path()]
    gemma = Path(__file__).resolve().parents[2] / ".cache" / "models" / "gemma-3-270m-q4_k_m.gguf"
    if os.path.isfile(gemma):
        models.append(str(gemma))
    return models


def run(args) -> int:
    from ..tokenizer import Tokenizer
    from ..tokenizer.pretokenize import get_pretokenizer

    text = english_text(int((0.05 if args.quick else args.mb) * 1_000_000))
    mb = len(text.encode("utf-8")) / 1e6
    print(f"text: {mb:.2f} MB of standard-library docstrings, {len(text):,} characters")
    split = get_pretokenizer("gpt2")
    split("warm-up: builds the Unicode classes once")
    t0 = time.perf_counter()
    pieces = split(text)
    t_regex = time.perf_counter() - t0
    print(f"re-only GPT-2 pre-tokenization: {t_regex:.2f} s ({len(pieces):,} pieces)")
    for path in args.model or _default_models():
        t0 = time.perf_counter()
        tok = Tokenizer.from_gguf(path)
        t_load = time.perf_counter() - t0
        t0 = time.perf_counter()
        ids = tok.encode(text)
        t_cold = time.perf_counter() - t0
        t0 = time.perf_counter()
        again = tok.encode(text)
        t_warm = time.perf_counter() - t0
        t0 = time.perf_counter()
        back = tok.decode(ids)
        t_dec = time.perf_counter() - t0
        ok = "round-trip ok" if back == text and again == ids else "ROUND-TRIP MISMATCH"
        print(f"{path.rsplit('/', 1)[-1]}: {tok.kind}, vocab {tok.vocab_size}, built in {t_load:.2f} s")
        print(f"  encode cold {t_cold:.2f} s = {mb / t_cold:.2f} MB/s ({len(ids) / t_cold:,.0f} tokens/s, "
              f"{len(ids):,} tokens); warm {t_warm:.2f} s = {mb / t_warm:.2f} MB/s")
        print(f"  decode {t_dec:.3f} s = {mb / t_dec:.1f} MB/s; cold encode / re-only split = "
              f"{t_cold / t_regex:.1f}x; {ok}")
    return 0
