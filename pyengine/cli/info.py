"""`pyengine info [MODEL]`: what is inside a GGUF file -- hyper-parameters, tokenizer, quant types, tensors."""
from __future__ import annotations

import argparse
from collections import defaultdict



def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None, help="GGUF file (default: the bundled SmolLM2-135M)")
    p.add_argument("--model", dest="model_opt", default=None, metavar="PATH", help="GGUF file (same as MODEL)")
    p.add_argument("--tensors", action="store_true", help="also list every tensor (name, shape, type, bytes)")


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
        ("architectures run", ", ".join(sorted(ARCHITECTURES))),
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


def run(args) -> int:
    from pyengine.gguf.reader import GGUFFile
    from pyengine.model_files import resolve_model

    path = resolve_model(args.model_opt or args.model)
    print(describe(GGUFFile(path), path=path, tensors=args.tensors))
    return 0
