"""`pyengine info [MODEL]`: what is inside a GGUF file -- hyper-parameters, tokenizer, quant types, tensors."""
from __future__ import annotations

import argparse
from collections import defaultdict



def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None, help="GGUF file (default: the bundled SmolLM2-135M)")
    p.add_argument("--model", dest="model_opt", default=None, metavar="PATH", help="GGUF file (same as MODEL)")
    p.add_argument("--tensors", action="store_true", help="also list every tensor (name, shape, type, bytes)")
    p.add_argument("--memory", action="store_true",
                   help="S21: what each weights mode (resident, lean) would hold for one sequence")
    p.add_argument("--max-model-len", type=int, default=None, metavar="N",
                   help="context of that sequence (--memory; default: the model's)")
    from pyengine.engine.kv_cache import KV_DTYPES
    p.add_argument("--kv-cache-dtype", default=None, choices=KV_DTYPES,
                   help="KV cache storage (--memory; default: each mode's: auto resident, q8_0 lean)")


def _human(n: float, unit: str = "B") -> str:
    for prefix in ("", "K", "M", "G", "T"):
        if abs(n) < 1000 or prefix == "T":
            return f"{n:.1f} {prefix}{unit}" if prefix else f"{n:.0f} {unit}"
        n /= 1000
    return f"{n} {unit}"


def describe(gguf, path: str | None = None, tensors: bool = False) -> str:
    """The report printed by `pyengine info`, as text."""
    from pyengine.config import ModelConfig
    from pyengine.gguf.quants import type_name
    from pyengine.models import ARCHITECTURES, load_config

    cfg = ModelConfig.from_gguf(gguf, partial_rotary=True)     # describes; the architecture decides what runs
    md = gguf.metadata
    try:                                                  # the architecture's own defaults (S16 experts)
        moe = getattr(load_config(gguf), "moe", None) if cfg.arch in ARCHITECTURES else None
    except ValueError as e:                               # GGUFError: still describe the rest of the file
        moe, moe_error = None, str(e)
    else:
        moe_error = None
    rows = [
        ("file", f"{path or '<bytes>'}"),
        ("file size", f"{_human(gguf.file_size)} ({gguf.file_size} bytes), GGUF v{gguf.version}, "
                      f"alignment {gguf.alignment}, {len(md)} metadata keys"),
        ("name", str(md.get("general.name", "?"))),
        ("architecture", cfg.arch + ("" if cfg.arch in ARCHITECTURES else "  (readable; no forward pass for it)")),
        ("layers", str(cfg.n_layers)),
        ("hidden size", str(cfg.d_model)),
        ("heads (q/kv)", f"{cfg.n_heads}/{cfg.n_kv_heads}"),
        ("head dim", str(cfg.head_dim) + ("" if cfg.rope_dim == cfg.head_dim else
                                          f" (rotary: the first {cfg.rope_dim})")),
        ("FFN size", str(cfg.ffn_dim)),
        *([("experts (S16)", f"{moe.n_experts} of {moe.expert_ffn} rows, top-{moe.n_used} ({moe.gating}"
                             f"{', renormalised' if moe.norm_weights else ''}), shared expert "
                             f"{moe.shared_ffn or 'none'}")] if moe else []),
        *([("experts (S16)", f"invalid: {moe_error}")] if moe_error else []),
        ("vocab", str(cfg.vocab_size)),
        ("context length", str(cfg.context_length)),
        ("rope base", f"{cfg.rope_theta:g}"),
        ("rope scaling", cfg.rope_scaling_type if cfg.rope_scaling_type == "none" else
         f"{cfg.rope_scaling_type} x{cfg.rope_scaling_factor:g} (trained at {cfg.rope_orig_context})"),
        ("rms eps", f"{cfg.rms_eps:g}"),
        ("tokenizer", f"{md.get('tokenizer.ggml.model', '?')} (pre: {md.get('tokenizer.ggml.pre', '-')})"),
        ("bos / eos", f"{cfg.bos_token_id} / {cfg.eos_token_id}"),
        ("tied embeddings", "yes" if cfg.tie_embeddings else "no"),
        ("parameters", f"{cfg.n_params / 1e6:.1f}M ({cfg.n_params})"),
        ("runs (S03)", ", ".join(sorted(ARCHITECTURES))),    # the architectures pyengine runs
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}} : {v}" for k, v in rows]

    by_type: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    for t in gguf.tensors.values():
        entry = by_type[type_name(t.ggml_type)]
        entry[0] += 1
        entry[1] += t.n_elements
        entry[2] += t.nbytes
    lines += ["", f"{'type':<8} {'tensors':>8} {'params':>12} {'bytes':>12} {'bits/weight':>12}"]
    for name, (count, n, nbytes) in sorted(by_type.items(), key=lambda kv: -kv[1][2]):
        lines.append(f"{name:<8} {count:>8} {n:>12} {nbytes:>12} {8 * nbytes / n:>12.2f}")
    total_bytes = sum(v[2] for v in by_type.values())
    lines.append(f"{'total':<8} {len(gguf.tensors):>8} {cfg.n_params:>12} {total_bytes:>12} "
                 f"{8 * total_bytes / max(cfg.n_params, 1):>12.2f}")

    if tensors:
        name_w = max((len(n) for n in gguf.tensors), default=4)
        lines += ["", f"{'tensor':<{name_w}} {'shape':<16} {'type':<6} {'bytes':>10}"]
        for t in gguf.tensors.values():
            lines.append(f"{t.name:<{name_w}} {str(list(t.shape)):<16} {type_name(t.ggml_type):<6} {t.nbytes:>10}")
    return "\n".join(lines)


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def memory_report(gguf, max_model_len: int | None = None, kv_cache_dtype: str | None = None) -> str:
    """S21: `pyengine info --memory`: resident vs lean for one sequence of max_model_len tokens."""
    from pyengine.config import ModelConfig
    from pyengine.engine.lean_mode import memory_plan

    n = max_model_len or ModelConfig.from_gguf(gguf).context_length or 2048
    plans = {mode: memory_plan(gguf, mode, n, kv_cache_dtype) for mode in ("resident", "lean")}
    rows = [("weights (private)", "weights"), ("weights (file-backed, evictable)", "mapped"),
            ("KV cache", "kv_cache"), ("other buffers (arena)", "buffers")]
    width = 34
    lines = [f"memory for one sequence of {n} tokens:", f"{'':<{width}} {'resident':>14} {'lean':>14}"]
    for label, key in rows:
        lines.append(f"{label:<{width}} {_mib(plans['resident'][key]):>14} {_mib(plans['lean'][key]):>14}")
    total = {m: p["weights"] + p["kv_cache"] + p["buffers"] for m, p in plans.items()}
    lines.append(f"{'private total (+ Python, NumPy)':<{width}} {_mib(total['resident']):>14} {_mib(total['lean']):>14}")
    lines.append(f"{'KV cache type, batch tokens':<{width}} "
                 + " ".join(f"{p['kv_cache_dtype'] + ', ' + str(p['max_num_batched_tokens']):>14}"
                            for p in plans.values()))
    return "\n".join(lines)


def run(args) -> int:
    from pyengine.gguf.reader import GGUFFile
    from pyengine.model_files import resolve_model

    path = resolve_model(args.model_opt or args.model)
    gguf = GGUFFile(path)
    if getattr(args, "memory", False):
        print(memory_report(gguf, args.max_model_len, args.kv_cache_dtype))
        return 0
    print(describe(gguf, path=path, tensors=args.tensors))
    return 0
