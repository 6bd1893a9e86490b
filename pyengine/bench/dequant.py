"""`pyengine bench dequant`: dequantization throughput per ggml format (S08).

For each supported format it decodes a real tensor of that type when one of the given models has it
(rows capped so every format moves a comparable amount of data), synthetic random blocks otherwise, and
reports MB/s of float32 output and of quantized input. When the `gguf` package is installed, its NumPy
dequantizer runs on the same bytes in the same run: the ratio column is our speed / its speed, and the
"exact" column says whether both produced the same bits.
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np

HELP = "dequantization MB/s per quant format, against the gguf package's NumPy dequantizer"

# The Gemma 3 file made by scripts/assemble_gemma.py (real Q4_K/Q6_K/Q5_0 tensors), in the source checkout.
GEMMA_DEFAULT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                             ".cache", "models", "gemma-3-270m-q4_k_m.gguf")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", action="append", default=None, metavar="PATH",
                   help="GGUF file(s) to take real tensors from (default: SmolLM2 and, if present, "
                        f"{GEMMA_DEFAULT})")
    p.add_argument("--weights", type=int, default=1 << 21, help="weights decoded per format (default 2M)")
    p.add_argument("--repeat", type=int, default=5, help="timed runs per measurement; the best is kept")
    p.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                   help="cpu (default): process CPU time, robust on a shared machine (the kernels are "
                        "single-threaded); wall: elapsed time")
    p.add_argument("--no-reference", action="store_true", help="skip the gguf package comparison")
    p.add_argument("--quick", action="store_true", help="4096 weights per format, one run (a smoke test)")


def _best_times(fns, repeat: int, clock=time.process_time) -> list[float]:
    """Best wall time of each function, running them in alternation so that load from other processes
    (the machine is shared) hits all of them alike."""
    best = [float("inf")] * len(fns)
    for _ in range(max(1, repeat)):
        for i, fn in enumerate(fns):
            t0 = clock()
            fn()
            best[i] = min(best[i], clock() - t0)
    return best


def _synthetic(ggml_type, n_weights: int, rng: np.random.Generator) -> tuple[np.ndarray, tuple[int, ...]]:
    """Random blocks with finite float16 scales (random bytes there would be inf/NaN half the time)."""
    from pyengine.gguf.quants import GGML_BLOCK
    layout = GGML_BLOCK[ggml_type]
    row = 4096 if layout.block_size > 1 else 1024
    rows = max(1, n_weights // row)
    n_blocks = rows * row // layout.block_size
    raw = rng.integers(0, 256, n_blocks * layout.type_size, dtype=np.uint8)
    view = raw.view(layout.dtype)
    if layout.dtype.names is None:   # F32/F16/BF16: plain numbers
        values = rng.standard_normal(n_blocks).astype(np.float32)
        if layout.dtype == np.dtype("<f2"):
            view[:] = values.astype(np.float16)
        elif layout.dtype == np.dtype("<u2"):
            view[:] = values.view(np.uint32) >> 16
        else:
            view[:] = values
    else:
        for name in layout.dtype.names:
            if layout.dtype[name] == np.dtype("<f2"):
                view[name] = (rng.standard_normal(view[name].shape) * 0.01).astype(np.float16)
    return raw, (rows, row)


def _real_tensor(files, ggml_type, n_weights: int):
    """The largest tensor of that type among the files, cut to about n_weights (whole rows)."""
    from pyengine.gguf import quants
    best = None
    for g in files:
        for t in g.tensors.values():
            if t.ggml_type == ggml_type and (best is None or t.n_elements > best.n_elements):
                best = t
    if best is None or best.n_elements < n_weights // 16:   # e.g. only small F32 norm vectors
        return None
    rows_total = best.shape[0] if len(best.shape) == 2 else 1
    row = best.n_elements // rows_total
    rows = max(1, min(rows_total, n_weights // row))
    shape = (rows, row) if len(best.shape) == 2 else best.shape
    return best.name, best.data[:quants.tensor_nbytes(ggml_type, shape)], shape


def run(args) -> int:
    from pyengine.gguf import quants
    from pyengine.gguf.reader import GGUFFile
    from pyengine.model_files import default_model_path

    if args.quick:
        args.weights, args.repeat = 4096, 1
    if args.weights < 256 or args.repeat < 1:
        raise ValueError("--weights must be >= 256 and --repeat >= 1")
    paths = args.model
    if paths is None:
        paths = [default_model_path()] + ([GEMMA_DEFAULT] if os.path.isfile(GEMMA_DEFAULT) else [])
    files = [GGUFFile(p) for p in paths]
    reference = None
    if not args.no_reference:
        try:
            import gguf.quants as reference   # the `gguf` package (test/bench dependency only)
            from gguf import GGMLQuantizationType
        except ImportError:
            print("(gguf package not installed: no reference column)")
    rng = np.random.default_rng(0)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter

    print(f"models: {', '.join(os.path.basename(p) for p in paths)}; ~{args.weights} weights per format, "
          f"best of {args.repeat}, {args.clock} time; MB = 1e6 bytes")
    header = (f"{'format':<6} {'source':<28} {'weights':>9} {'out MB/s':>9} {'in MB/s':>9} "
              f"{'gguf out MB/s':>13} {'ratio':>6} {'exact':>5}")
    print(header)
    print("-" * len(header))
    ratios = []
    for t in quants.SUPPORTED_TYPES:
        real = _real_tensor(files, t, args.weights)
        if real is not None:
            source, raw, shape = real
        else:
            raw, shape = _synthetic(t, args.weights, rng)
            source = "synthetic"
        n = int(np.prod(shape))
        ours = quants.dequantize(raw, t, shape)     # warm-up, and the result compared below
        fns = [lambda: quants.dequantize(raw, t, shape)]
        if reference is not None:
            qtype = GGMLQuantizationType(int(t))
            rows = raw.reshape(shape[0] if len(shape) == 2 else 1, -1)
            fns.append(lambda: reference.dequantize(rows, qtype))
        with np.errstate(all="ignore"):
            times = _best_times(fns, args.repeat, clock)
        dt = times[0]
        out_mbs, in_mbs = n * 4 / dt / 1e6, raw.size / dt / 1e6
        ref_cols = f"{'-':>13} {'-':>6} {'-':>5}"
        if reference is not None:
            want = np.asarray(fns[1](), np.float32).reshape(shape)
            exact = np.array_equal(ours.view(np.uint32), want.view(np.uint32))
            rdt = times[1]
            ratio = rdt / dt
            if t != quants.GGMLType.F32:   # gguf "dequantizes" F32 as a zero-copy view: nothing to compare
                ratios.append(ratio)
            ref_cols = f"{n * 4 / rdt / 1e6:>13.0f} {ratio:>5.2f}x {'yes' if exact else 'NO':>5}"
        print(f"{t.name:<6} {source[:28]:<28} {n:>9} {out_mbs:>9.0f} {in_mbs:>9.0f} {ref_cols}")
    if ratios:
        geo = float(np.exp(np.mean(np.log(ratios))))
        print(f"geometric mean speed ratio vs gguf package over the {len(ratios)} formats it decodes "
              f"(F32 excluded: it returns a view): {geo:.2f}x (> 1: pyengine faster)")
    return 0
