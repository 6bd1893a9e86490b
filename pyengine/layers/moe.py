"""S16: mixture of experts — sparse compute, dense memory; routing is a load-balancing problem.

An MoE feed-forward replaces one gated MLP by E of them ("experts") and a router that picks k per token:

    p = gating(x · Wr)                     softmax (Mixtral, Qwen) or sigmoid (DeepSeek V3) over the E experts
    S = top-k of (p + bias)                the optional bias moves the selection only, never the weights
    w = p[S]  (/ sum(p[S]) if normalised)  (* scale)
    y = sum_{e in S} w_e · down_e(act(gate_e · x) * up_e · x)   (+ sigmoid(x · g_sh) · shared(x))

Every token holds all E experts in memory but multiplies only k of them: compute falls by E/k, memory does not.
The fast path never loops over tokens: the (token, expert) pairs are sorted by expert, each used expert
multiplies its tokens' rows in one product, the results are weighted and summed back per token
(``moe_forward``). ``moe_reference`` is the readable per-token form it is tested against.

Experts stay as the GGUF stacks them (``blk.N.ffn_{gate,up,down}_exps``: (E, F, d), (E, F, d), (E, d, F);
router ``ffn_gate_inp`` (E, d); shared expert ``*_shexp`` and its gate ``ffn_gate_inp_shexp``): resident mode
dequantizes them once; lean mode keeps the quantized rows and dequantizes only the experts a step uses, one at
a time, into the arena's lean scratch. ``ExpertLoad`` counts the tokens each expert received over a window of
steps (balance = mean / max: 1.0 is a perfectly even load).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from pyengine.arena import spec
from pyengine.gguf import GGUFError, quants
from pyengine.layers.activation import gated_activation
from pyengine.layers.linear import Linear, dense_matmul

# llama.cpp's llama_expert_gating_func_type (metadata {arch}.expert_gating_func)
GATING_FUNCS = {1: "softmax", 2: "sigmoid"}


@dataclass(frozen=True)
class MoEConfig:
    n_experts: int             # E
    n_used: int                # k experts per token
    expert_ffn: int            # F of one expert
    shared_ffn: int            # F of the shared expert (0: none)
    norm_weights: bool         # renormalise the top-k weights to sum to 1
    weights_scale: float       # multiplies the top-k weights
    gating: str                # "softmax" or "sigmoid"

    @classmethod
    def from_gguf(cls, md: dict, arch: str, expert_ffn_default: int | None = None, norm_default: bool = False,
                  gating_default: str = "softmax") -> "MoEConfig | None":
        """The MoE keys of ``{arch}.*`` (llama.cpp's names), or None when the file has no ``expert_count``.
        ``*_default``: what llama.cpp assumes for the architecture when a key is absent."""
        if f"{arch}.expert_count" not in md:
            return None

        def count(key, default=None, minimum=1):
            v = md.get(f"{arch}.{key}", default)
            if v is None:
                raise GGUFError(f"required metadata key '{arch}.{key}' is missing")
            if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
                raise GGUFError(f"metadata key '{arch}.{key}' = {v!r:.40} must be an integer >= {minimum}")
            return int(v)

        E, k = count("expert_count"), count("expert_used_count")
        if k > E:
            raise GGUFError(f"metadata key '{arch}.expert_used_count' = {k} exceeds '{arch}.expert_count' = {E}")
        norm = md.get(f"{arch}.expert_weights_norm", norm_default)
        if not isinstance(norm, (bool, np.bool_)):
            raise GGUFError(f"metadata key '{arch}.expert_weights_norm' = {norm!r:.40} must be a bool")
        scale = md.get(f"{arch}.expert_weights_scale", 1.0)
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
            raise GGUFError(f"metadata key '{arch}.expert_weights_scale' = {scale!r:.40} must be a positive number")
        func = md.get(f"{arch}.expert_gating_func")
        if func is None:
            gating = gating_default
        elif isinstance(func, int) and not isinstance(func, bool) and func in GATING_FUNCS:
            gating = GATING_FUNCS[func]
        else:
            raise GGUFError(f"metadata key '{arch}.expert_gating_func' = {func!r:.40} is not a known gating "
                            f"function ({', '.join(f'{n} = {v}' for n, v in GATING_FUNCS.items())})")
        return cls(n_experts=E, n_used=k, expert_ffn=count("expert_feed_forward_length", expert_ffn_default),
                   shared_ffn=count("expert_shared_feed_forward_length", 0, minimum=0), norm_weights=bool(norm),
                   weights_scale=float(scale), gating=gating)


class Experts:
    """One layer's E experts as the GGUF stacks them (not a Linear: a product picks one expert per call).
    Resident: float32 ``gate_up`` (E, d, 2F) and ``down`` (E, F, d), dequantized once. Lean: the quantized rows
    (E, F or d, row bytes) of gate, up and down, dequantized per used expert into ``scratch`` (bound by the
    runner: the arena's lean region, shared with the lean matrices)."""

    held: tuple | None = None     # S17 expert parallelism (parallel_linear.ExpertSlice): the experts held here
    comm = None                   # ... and the ranks' Allreduce that ends the layer

    def __init__(self, gate: tuple, up: tuple, down: tuple, d: int, f: int, mode: str, act: str = "silu"):
        """gate, up, down: (raw uint8 (E, rows, row_bytes), ggml_type) as TensorReader.stacked reads them."""
        self.d, self.f, self.act, self.mode = d, f, act, mode
        self.n_experts = gate[0].shape[0]
        self.scratch: np.ndarray | None = None
        if mode == "resident":
            E = self.n_experts
            g, u = (quants.dequantize(r, t, (E, f, d)) for r, t in (gate, up))
            self.gate_up = np.ascontiguousarray(np.concatenate([g, u], axis=1).transpose(0, 2, 1))  # (E, d, 2F)
            del g, u
            self.down = np.ascontiguousarray(quants.dequantize(*down, (E, d, f)).transpose(0, 2, 1))  # (E, F, d)
            self.nbytes = self.gate_up.nbytes + self.down.nbytes
        elif mode == "lean":
            self.q = (gate, up, down)
            self.nbytes = sum(r.nbytes for r, _ in self.q)
        else:
            raise ValueError(f"weights mode must be 'resident' or 'lean', got {mode!r}")

    @property
    def scratch_floats(self) -> int:
        """Lean: one expert's gate|up (2F x d) — its down (d x F) reuses the same floats afterwards."""
        return 2 * self.f * self.d if self.mode == "lean" else 0

    def weights(self, e: int) -> tuple[np.ndarray, np.ndarray]:
        """Expert e's (d, 2F) gate|up and (F, d) down as float32 (references, benchmarks; lean: allocates)."""
        if self.mode == "resident":
            return self.gate_up[e], self.down[e]
        (g, tg), (u, tu), (dn, td) = self.q
        gu = np.concatenate([quants.dequantize(g[e], tg, (self.f, self.d)),
                             quants.dequantize(u[e], tu, (self.f, self.d))]).T
        return gu, quants.dequantize(dn[e], td, (self.d, self.f)).T

    def ffn(self, e: int, x: np.ndarray, out: np.ndarray, gate_up: np.ndarray, h: np.ndarray) -> np.ndarray:
        """out (n, d) = down_e(act(gate_e x) * up_e x) for x (n, d), through gate_up (n, 2F) and h (n, F)."""
        if self.mode == "resident":
            dense_matmul(x, self.gate_up[e], gate_up)
            gated_activation(gate_up, self.act, out=h)
            return dense_matmul(h, self.down[e], out)
        (g, tg), (u, tu), (dn, td) = self.q
        d, f = self.d, self.f
        buf = np.empty(self.scratch_floats, np.float32) if self.scratch is None else self.scratch
        rows = buf[:2 * f * d].reshape(2 * f, d)
        quants.dequantize(g[e], tg, (f, d), out=rows[:f])
        quants.dequantize(u[e], tu, (f, d), out=rows[f:])
        np.matmul(x, rows.T, out=gate_up)
        gated_activation(gate_up, self.act, out=h)
        rows = buf[:d * f].reshape(d, f)
        quants.dequantize(dn[e], td, (d, f), out=rows)
        return np.matmul(h, rows.T, out=out)


class MoE(NamedTuple):
    """One layer's MoE weights besides the shared expert's matrices (which are Linears of the layer, so tensor
    parallelism and lean scratch treat them like any other)."""
    router: np.ndarray                 # (d, E) float32: router logits = x @ router
    experts: Experts
    bias: np.ndarray | None = None     # (E,) selection bias (moves the top-k choice, not the weights)
    shared_gate: np.ndarray | None = None  # (d,) shared expert's gate: sigmoid(x @ shared_gate)

    @property
    def nbytes(self) -> int:
        return self.router.nbytes + self.experts.nbytes + sum(a.nbytes for a in (self.bias, self.shared_gate)
                                                               if a is not None)


class MoEScratch(NamedTuple):
    """The arena regions of an MoE layer (names "moe.*"), for T tokens and T*k (token, expert) pairs."""
    logits: np.ndarray      # (T, E) router logits, then probabilities
    xs: np.ndarray          # (T k, d) the inputs gathered in expert order
    gate_up: np.ndarray     # (T k, 2F)
    h: np.ndarray           # (T k, F)
    ys: np.ndarray          # (T k, d) expert outputs, in expert order (then back in (token, slot) order in xs)
    sh_gate_up: np.ndarray  # (T, 2 Fs) shared expert
    sh_h: np.ndarray        # (T, Fs)
    sh_out: np.ndarray      # (T, d)
    sh_gate: np.ndarray     # (T, 1)
    k: int

    @staticmethod
    def specs(m: MoEConfig, d: int, max_tokens: int) -> list:
        n, fs = max_tokens * m.n_used, m.shared_ffn
        return [spec("moe.logits", (max_tokens, m.n_experts)), spec("moe.xs", (n, d)),
                spec("moe.gate_up", (n, 2 * m.expert_ffn)), spec("moe.h", (n, m.expert_ffn)),
                spec("moe.ys", (n, d)), spec("moe.sh_gate_up", (max_tokens, 2 * fs)),
                spec("moe.sh_h", (max_tokens, fs)), spec("moe.sh_out", (max_tokens, d)),
                spec("moe.sh_gate", (max_tokens, 1))]

    @classmethod
    def from_arena(cls, views: dict, k: int) -> "MoEScratch":
        return cls(*(views["moe." + n] for n in cls._fields[:-1]), k=k)

    def rows(self, T: int) -> "MoEScratch":
        pairs = ("xs", "gate_up", "h", "ys")
        return self._replace(**{n: getattr(self, n)[:T * self.k if n in pairs else T] for n in self._fields[:-1]})


def gate_probs(logits: np.ndarray, gating: str, out: np.ndarray | None = None) -> np.ndarray:
    """softmax over the experts (float32, as HF computes it) or an independent sigmoid per expert."""
    out = np.empty_like(logits) if out is None else out
    if gating == "softmax":
        np.subtract(logits, logits.max(axis=-1, keepdims=True), out=out)
        np.exp(out, out=out)
        out /= out.sum(axis=-1, keepdims=True)
    elif gating == "sigmoid":
        np.negative(logits, out=out)
        np.exp(out, out=out)
        out += 1.0
        np.reciprocal(out, out=out)
    else:
        raise ValueError(f"unknown gating function {gating!r}")
    return out


def route(probs: np.ndarray, m: MoEConfig, bias: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(experts (T, k) int64, weights (T, k) float32) of each token: the top k of probs (+ bias), their
    probabilities, renormalised and scaled as the config says."""
    k = m.n_used
    scores = probs if bias is None else probs + bias
    sel = np.argpartition(-scores, k - 1, axis=-1)[:, :k] if k < m.n_experts else \
        np.broadcast_to(np.arange(k), probs.shape).copy()
    w = probs[np.arange(len(sel))[:, None], sel]          # (take_along_axis costs 4x more for a decode)
    if m.norm_weights:
        w /= w.sum(axis=-1, keepdims=True)
    if m.weights_scale != 1.0:
        w *= np.float32(m.weights_scale)
    return sel, w


def moe_forward(moe: MoE, m: MoEConfig, x: np.ndarray, out: np.ndarray, s: MoEScratch,
                shared_gate_up: Linear | None = None, shared_down: Linear | None = None) -> np.ndarray:
    """out (T, d) = the MoE feed-forward of x (T, d), grouped by expert; returns the tokens each expert got (E,).
    ``s``: the scratch cut to T rows (MoEScratch.rows)."""
    T, k = x.shape[0], m.n_used
    np.matmul(x, moe.router, out=s.logits)
    probs = gate_probs(s.logits, m.gating, out=s.logits)
    sel, w = route(probs, m, moe.bias)
    flat = sel.reshape(-1)
    order = np.argsort(flat, kind="stable")              # (token, slot) pairs sorted by expert
    counts = np.bincount(flat, minlength=m.n_experts)
    np.take(x, order // k, axis=0, out=s.xs)
    bounds = np.concatenate([[0], np.cumsum(counts)])
    held = moe.experts.held
    for e in np.flatnonzero(counts).tolist():            # one product per used expert, over all its tokens
        a, b = int(bounds[e]), int(bounds[e + 1])
        if held is not None and not held[0] <= e < held[1]:
            s.ys[a:b] = 0.0                               # S17: another rank's expert; its rows come in the sum
            continue
        moe.experts.ffn(e, s.xs[a:b], s.ys[a:b], s.gate_up[a:b], s.h[a:b])
    np.multiply(s.ys, w.reshape(-1)[order][:, None], out=s.ys)
    inverse = np.empty_like(order)
    inverse[order] = np.arange(len(order))
    yk = np.take(s.ys, inverse, axis=0, out=s.xs)        # back to (token, slot) order, into the free xs
    np.sum(yk.reshape(T, k, -1), axis=1, out=out)
    if shared_down is not None:
        shared_gate_up.gated(x, out=s.sh_h, scratch=s.sh_gate_up)
        shared_down.matmul(s.sh_h, out=s.sh_out)
        np.matmul(x, moe.shared_gate[:, None], out=s.sh_gate)
        np.multiply(s.sh_out, gate_probs(s.sh_gate, "sigmoid", out=s.sh_gate), out=s.sh_out)
        out += s.sh_out
    if moe.experts.comm is not None:                     # S17: the ranks' experts (and shared columns) summed
        moe.experts.comm.allreduce(out)
    return counts


def moe_reference(moe: MoE, m: MoEConfig, x: np.ndarray, shared_gate_up: Linear | None = None,
                  shared_down: Linear | None = None) -> np.ndarray:
    """The readable form: for each token, its k experts one by one (what ``moe_forward`` must equal)."""
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        p = gate_probs(x[t:t + 1] @ moe.router, m.gating)
        sel, w = route(p, m, moe.bias)
        for e, we in zip(sel[0], w[0]):
            gu, down = moe.experts.weights(int(e))
            out[t] += we * (gated_activation(x[t] @ gu, moe.experts.act) @ down)
    if shared_down is not None:
        sh = gated_activation(x @ shared_gate_up, shared_gate_up.act) @ shared_down
        out += sh / (1.0 + np.exp(-(x @ moe.shared_gate)))[:, None]
    return out


class ExpertLoad:
    """Tokens routed to each expert of each MoE layer over the last ``window`` forward steps."""

    def __init__(self, moe_layers: list[int], n_experts: int, window: int = 64):
        self.layers = list(moe_layers)
        self.row = {layer: r for r, layer in enumerate(self.layers)}
        self.counts = np.zeros((window, len(self.layers), n_experts), np.int64)
        self.step = -1                                   # ring slot of the current step
        self.steps = 0

    def add(self, layer: int, counts: np.ndarray) -> None:
        r = self.row[layer]
        if r == 0:                                       # the first MoE layer opens a new step
            self.step = (self.step + 1) % self.counts.shape[0]
            self.counts[self.step] = 0
            self.steps += 1
        self.counts[self.step, r] += counts

    def snapshot(self) -> dict:
        """{"window_steps", "layers": [{"layer", "tokens": per expert, "balance": mean/max}], "balance"}."""
        total = self.counts.sum(axis=0)                  # (layers, E)
        rows = []
        for layer, tok in zip(self.layers, total):
            top = int(tok.max())
            rows.append({"layer": layer, "tokens": tok.tolist(),
                         "balance": round(float(tok.mean() / top), 4) if top else None})
        bal = [r["balance"] for r in rows if r["balance"] is not None]
        return {"window_steps": min(self.steps, self.counts.shape[0]), "layers": rows,
                "balance": round(float(np.mean(bal)), 4) if bal else None}
