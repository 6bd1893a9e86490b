"""`pyengine bench [WHAT]`: benchmarks that print figures and ratios measured in the same run.

Each benchmark is a module `pyengine.bench.<what>` with ``HELP``, ``add_arguments(parser)`` and ``run(args)``.
"""
from __future__ import annotations

import argparse
import importlib

HELP = "run a benchmark (default: single-stream decode/prefill against the NumPy roofline)"

BENCHMARKS = {
    "engine": "pyengine.bench.engine",        # S03/S05/S12: decode, prefill, roofline, KV-cache scaling
    "dequant": "pyengine.bench.dequant",      # S08: dequantization MB/s per format
    "tokenizer": "pyengine.bench.tokenizer",  # S02: encode throughput
    "paging": "pyengine.bench.paging",        # S06/S07/S09/S11: KV waste, prefix cache TTFT, batching, chunking
    "serve": "pyengine.bench.serve",          # S20: Poisson load against an OpenAI-compatible server
    "tuning": "pyengine.bench.tuning",        # sweep one constant of pyengine/tuning.py
    "linear": "pyengine.bench.linear",        # S14: rows 1..12 per Linear kind, (k+1)-token verification cost
    "spec": "pyengine.bench.spec",            # S14: speculative decoding, ngram / draft model vs plain decode
    "kv": "pyengine.bench.kv",                # S08: KV cache dtypes and weight formats: memory, PPL/KL, speed
    "structured": "pyengine.bench.structured",  # S15: grammar compile/mask time, coverage, validity vs peers
    "moe": "pyengine.bench.moe",              # S16: MoE vs dense (same active / same total parameters)
    "parallel": "pyengine.bench.parallel",    # S17: one process vs TP / PP over MPI
    "replay": "pyengine.bench.replay",        # S13: decode step plain vs captured and replayed
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("what", nargs="?", default="engine", choices=sorted(BENCHMARKS))
    p.add_argument("rest", nargs=argparse.REMAINDER, help="options of that benchmark (see pyengine bench WHAT -h)")
    p.add_argument("--quick", action="store_true", help="toy sizes: a smoke run of the benchmark (every one has it)")


def run(args) -> int:
    module = importlib.import_module(BENCHMARKS[args.what])
    p = argparse.ArgumentParser(prog=f"pyengine bench {args.what}", description=module.HELP)
    module.add_arguments(p)
    rest = args.rest + (["--quick"] if args.quick and "--quick" not in args.rest else [])
    return int(module.run(p.parse_args(rest)) or 0)
