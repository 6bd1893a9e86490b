"""S03/S05: what every architecture shares — the run state (named arena buffers), the weights container, the
GGUF tensor readers, and the fast outer loop (embed, layers, final norm, LM head).

An architecture module (models/llama.py, models/gemma3.py) gives its config reader, its weight loader, its
readable ``forward_reference`` and the fast math of one layer (``layer``); the runner (engine/) plans each step
and calls ``model.forward(plan, kv, b)``. Nothing here knows a block table, a process or a timing.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import NamedTuple

import numpy as np

from pyengine import tuning
from pyengine.arena import ArenaSpec, spec
from pyengine.gguf import quants
from pyengine.layers.linear import BlockedLinear, DenseLinear, Embedding, LeanLinear, Linear, QuantMatrix
from pyengine.layers.activation import gated_activation
from pyengine.layers.moe import Experts, ExpertLoad, MoE, MoEScratch, moe_forward, moe_reference
from pyengine.layers.norm import rms_norm
from pyengine.layers.attention import cap_scores
from pyengine.layers.paged_attention import paged_attention
from pyengine.layers.rotary import (apply_rope, interleaved_to_half, rope_cos_sin, rope_inv_freq,
                                    yarn_attention_factor)


class EagerOps:
    """S13: how the fast path issues its operations. Model code calls only these methods: this class runs each
    call now (the plain step, and ``enforce_eager``); engine/graph_replay.py's ``StepCapture`` runs the same
    calls and also records each one, bound to its arrays, into a captured step that later steps replay."""

    def call(self, f, *args) -> None:
        f(*args)

    def rms_norm(self, x, weight, eps, out) -> None:
        rms_norm(x, weight, eps, out=out)

    def matmul(self, lin, x, out) -> None:
        lin.matmul(x, out)

    def gated(self, lin, x, out, scratch) -> None:
        lin.gated(x, out, scratch)

    def rope(self, x, cos, sin, out, tmp) -> None:
        apply_rope(x, cos, sin, out=out, tmp=tmp)

    def attention(self, i, q, kv, plan, out, scratch, scale, softcap=None) -> None:
        paged_attention(i, q, kv, plan, out=out, scratch=scratch, scale=scale, softcap=softcap)


EAGER = EagerOps()


class LayerKind(NamedTuple):
    """Layers that attend alike: Llama has one kind; Gemma 3 a sliding-window kind and a global one."""
    window: int | None         # sliding window (keys visible while i - j < window), or None: the whole context
    inv_freq: np.ndarray       # (hd/2,) RoPE inverse frequencies of these layers
    mscale: np.ndarray | float | None = None   # YaRN / LongRoPE: cos and sin times this (per pair), or None

    def cos_sin(self, positions) -> tuple[np.ndarray, np.ndarray]:
        """The RoPE tables (len(positions), hd/2) of these layers, ``mscale`` applied."""
        cos, sin = rope_cos_sin(positions, self.inv_freq)
        if self.mscale is not None:
            m = np.asarray(self.mscale, dtype=np.float32)
            cos, sin = cos * m, sin * m
        return cos, sin


def rope_kind(c, window: int | None = None, theta: float | None = None, freq_factors=None,
              scaled: bool = True) -> LayerKind:
    """The LayerKind of layers rotating all head_dim dims with the config's RoPE: base ``theta`` (default the
    file's), its scaling (none / linear / llama3 / yarn, with YaRN's attention factor on cos and sin) unless
    ``scaled`` is False (Gemma 3's local layers), llama.cpp's per-pair ``freq_factors``."""
    if not scaled:
        return LayerKind(window, rope_inv_freq(c.head_dim, theta or c.rope_theta))
    inv = rope_inv_freq(c.head_dim, theta or c.rope_theta, c.rope_scaling_type, c.rope_scaling_factor,
                        c.rope_orig_context, freq_factors=freq_factors, beta_fast=c.rope_beta_fast,
                        beta_slow=c.rope_beta_slow)
    m = (yarn_attention_factor(c.rope_scaling_factor, c.rope_attn_factor) if c.rope_scaling_type == "yarn"
         else c.rope_attn_factor)
    return LayerKind(window, inv, None if m == 1.0 else m)


@dataclass
class Buffers:
    """The run state: every activation of a forward pass, a named view of the one arena (llama2.c's RunState).
    T = tokens of the step (at most max_num_batched_tokens), d = model width, H / Hkv = query / KV heads,
    hd = head dim, F = FFN width, R = rows of logits planned, V = vocab. ``rows(T)`` cuts the per-token ones."""
    x: np.ndarray              # (T, d) residual stream
    xn: np.ndarray             # (T, d) normalized input of a sub-layer
    qkv: np.ndarray            # (T, (H + 2 Hkv) hd) fused Q|K|V projection
    qk: np.ndarray             # (T, H + Hkv, hd) Q and K heads before RoPE (after the q/k norms, if any)
    qk_rot: np.ndarray         # (T, H + Hkv, hd) Q and K heads after RoPE
    rope_tmp: np.ndarray       # (T, H + Hkv, hd/2) RoPE scratch
    attn: np.ndarray           # (T, H, hd) attention output
    proj: np.ndarray           # (T, d) output of Wo or Wdown
    gate_up: np.ndarray        # (T, 2F) fused gate|up projection
    ffn: np.ndarray            # (T, F) gated activation
    rope_rows: list            # per layer kind: (cos, sin) (T, H + Hkv, hd/2) this step's rows, repeated per head
    rope_tables: list          # per layer kind: (cos, sin) (max_model_len, hd/2), filled once
    k_ctx: np.ndarray          # (max_model_len, Hkv, hd) a prompt's gathered keys (non-consecutive blocks)
    v_ctx: np.ndarray          # (max_model_len, Hkv, hd)
    k_batch: np.ndarray        # (slots, Hkv, hd) padded keys of a batched query group (DECODE_SLOTS or more;
    #                            0 slots over an fp16 / q8_0 / q4_0 cache, read as stored)
    v_batch: np.ndarray        # (slots, Hkv, hd)
    scores: np.ndarray         # (n,) attention scores, sized for the largest of the attention paths
    logits_x: np.ndarray       # (R, d) hidden rows whose logits are wanted
    logits_xn: np.ndarray      # (R, d) the same, normalized
    logits: np.ndarray         # (R, V)
    lean: np.ndarray           # (n,) the weights scratch: a lean matrix's (or a head chunk's, or an expert's)
    #                            float32 rows, or a staged block of a resident matrix's rows (Pyodide)
    moe: MoEScratch | None = None   # MoE models (S16): router and grouped-expert regions "moe.*"

    PER_TOKEN = ("x", "xn", "qkv", "qk", "qk_rot", "rope_tmp", "attn", "proj", "gate_up", "ffn")

    def rows(self, T: int) -> "Buffers":
        cut = {n: getattr(self, n)[:T] for n in self.PER_TOKEN}
        return replace(self, **cut, moe=None if self.moe is None else self.moe.rows(T))

    @classmethod
    def specs(cls, c, n_kinds: int, max_tokens: int, max_model_len: int, max_logits: int, decode_slots: int,
              lean_floats: int, flash_min_query: int, kv_converts: bool = False) -> list[ArenaSpec]:
        """Arena regions for config ``c`` and the runner's limits (names: "act.x", "rope.0.cos", ...).
        ``kv_converts``: the KV cache is stored as fp16 / q8_0 / q4_0, whose query groups attend over the stored
        rows tile by tile (layers/attention.py stored_decode_attention): no float32 k_batch / v_batch then."""
        H, Hkv, hd, d = c.n_heads, c.n_kv_heads, c.head_dim, c.d_model
        g = H // Hkv
        # scores, plus half as much again for the halving key reductions (attention._reduce_keys)
        # A sequence never has more new tokens than a batch, and batches of at most SHORT_QUERY_MAX tokens (S21's
        # lean mode) only ever take the short-query path: no whole-context K/V copy, no prefill scores.
        long_ctx = max_model_len if max_tokens > tuning.SHORT_QUERY_MAX else 0
        plain = Hkv * min(flash_min_query - 1, max_tokens) * g * (long_ctx + long_ctx // 2 + 1) if long_ctx else 0
        flash = Hkv * (tuning.FLASH_TILE + tuning.FLASH_TILE // 2 + 1) * min(tuning.FLASH_Q_TILE, max_tokens) * g
        flash = flash if long_ctx else 0
        short = H * min(tuning.SHORT_QUERY_MAX, max_tokens) * decode_slots
        out = [spec("act.x", (max_tokens, d)), spec("act.xn", (max_tokens, d)),
               spec("act.qkv", (max_tokens, (H + 2 * Hkv) * hd)), spec("act.qk", (max_tokens, H + Hkv, hd)),
               spec("act.qk_rot", (max_tokens, H + Hkv, hd)), spec("act.rope_tmp", (max_tokens, H + Hkv, hd // 2)),
               spec("act.attn", (max_tokens, H, hd)), spec("act.proj", (max_tokens, d)),
               spec("act.gate_up", (max_tokens, 2 * c.ffn_dim)), spec("act.ffn", (max_tokens, c.ffn_dim))]
        for k in range(n_kinds):
            out += [spec(f"rope.{k}.table_cos", (max_model_len, hd // 2)),
                    spec(f"rope.{k}.table_sin", (max_model_len, hd // 2)),
                    spec(f"rope.{k}.cos", (max_tokens, H + Hkv, hd // 2)),
                    spec(f"rope.{k}.sin", (max_tokens, H + Hkv, hd // 2))]
        batch_slots = 0 if kv_converts else decode_slots
        out += [spec("attn.k_ctx", (long_ctx, Hkv, hd)), spec("attn.v_ctx", (long_ctx, Hkv, hd)),
                spec("attn.k_batch", (batch_slots, Hkv, hd)), spec("attn.v_batch", (batch_slots, Hkv, hd)),
                spec("attn.scores", (max(plain, flash, short),)),
                spec("logits.x", (max_logits, d)), spec("logits.xn", (max_logits, d)),
                spec("logits.out", (max_logits, c.vocab_size)), spec("lean.scratch", (lean_floats,))]
        if getattr(c, "moe", None) is not None:
            out += MoEScratch.specs(c.moe, d, max_tokens)
        return out

    @classmethod
    def from_arena(cls, arena, n_kinds: int) -> "Buffers":
        A = arena.views
        names = {"logits_x": "logits.x", "logits_xn": "logits.xn", "logits": "logits.out", "lean": "lean.scratch"}
        kw = {f.name: A[names.get(f.name) or ("act." if f.name in cls.PER_TOKEN else "attn.") + f.name]
              for f in fields(cls) if f.name not in ("rope_rows", "rope_tables", "moe")}
        if "moe.logits" in A:
            kw["moe"] = MoEScratch.from_arena(A, A["moe.xs"].shape[0] // A["moe.logits"].shape[0])
        kw["rope_rows"] = [(A[f"rope.{k}.cos"], A[f"rope.{k}.sin"]) for k in range(n_kinds)]
        kw["rope_tables"] = [(A[f"rope.{k}.table_cos"], A[f"rope.{k}.table_sin"]) for k in range(n_kinds)]
        return cls(**kw)


class Weights:
    """An architecture's weights: ``layers`` (a NamedTuple per layer, its matrices `Linear`s and its norms float32
    vectors), the embedding, the final norm and the LM head. ``mode``: "resident" (float32, dequantized once) or
    "lean" (quantized rows, dequantized into scratch on use). ``head_bias``: (V,) added to the logits (Qwen2's
    optional output.bias), or None."""
    head_bias: np.ndarray | None = None
    folded_output_norm: np.ndarray | None = None    # S13: the final norm's weight once folded into the head

    def __init__(self, config, mode: str, layers: list, embed: Embedding, output_norm: np.ndarray, head: Linear,
                 tied: bool, **extra):
        self.config, self.mode, self.layers = config, mode, layers
        self.embed, self.output_norm, self.head, self.tied = embed, output_norm, head, tied
        self.__dict__.update(extra)

    def linears(self):
        """(where, Linear) for every matrix: ("layer", i, field) and ("head",)."""
        for i, L in enumerate(self.layers):
            for name, value in zip(L._fields, L):
                if isinstance(value, Linear):
                    yield ("layer", i, name), value
        if self.head is not None:                  # None: a pipeline stage without the head (S17)
            yield ("head",), self.head

    def map_linears(self, fn) -> None:
        """Replace every matrix by fn(where, Linear) (S17 wraps them in parallel ones); the tied embedding
        follows the head."""
        for i, L in enumerate(self.layers):
            self.layers[i] = L._replace(**{n: fn(("layer", i, n), v) for n, v in zip(L._fields, L)
                                          if isinstance(v, Linear)})
        self.head = fn(("head",), self.head)
        if self.tied:
            self.embed = Embedding(self.head, self.config.d_model)

    @property
    def nbytes(self) -> int:
        seen, total = set(), 0 if self.output_norm is None else self.output_norm.nbytes
        for _, lin in self.linears():
            if id(lin) not in seen:
                seen.add(id(lin))
                total += lin.nbytes
        src = self.embed.source
        if not self.tied and id(src) not in seen:
            total += src.nbytes
        if self.head_bias is not None:
            total += self.head_bias.nbytes
        for L in self.layers:
            total += sum(v.nbytes for v in L if isinstance(v, (np.ndarray, MoE)))
        return total

    def _scratch_users(self):
        """The lean matrices, the lean experts (S16) and Pyodide's staged resident matrices: they share one
        weights scratch (layers run one after another)."""
        yield from (lin for _, lin in self.linears()
                    if isinstance(lin, LeanLinear) or isinstance(lin, DenseLinear) and lin.scratch_floats)
        yield from (v.experts for L in self.layers for v in L if isinstance(v, MoE) and v.experts.mode == "lean")

    @property
    def lean_floats(self) -> int:
        """Floats of scratch the lean matrices, experts and staged resident matrices need (0: none)."""
        return max((u.scratch_floats for u in self._scratch_users()), default=0)

    def bind_scratch(self, lean: np.ndarray) -> None:
        """Give every scratch user (lean matrices and experts, staged resident matrices) the arena's one scratch."""
        for u in self._scratch_users():
            u.scratch = lean


def fold_norms(w: Weights) -> None:
    """S13, at load: an RMSNorm's weight folded into the matrix it feeds, rms_norm(x, g) @ W = (x / rms(x)) @
    (diag(g) W), so each step skips one multiply per norm; the folded field becomes None (rms_norm skips it;
    forward_reference reads the same weights). Float32 matrices only (DenseLinear, the untied BlockedLinear
    head). Skipped, and why: quantized rows (lean mode) share one scale per 32 inputs, so a per-input weight
    could only be folded by requantizing (lossy) or by scaling the dequantized rows at every use (out / T
    times the work of scaling x); an MoE layer's ffn_norm feeds the router and every expert; a tied head's rows
    are also the embedding. Also folded, exactly: SiLU's two halvings into the gate columns (``silu_half``)."""
    for i, L in enumerate(w.layers):
        gu = getattr(L, "w_gate_up", None)
        if getattr(L, "moe", None) is None and isinstance(gu, DenseLinear) and gu.act == "silu":
            gu.scale_columns(gu.shape[1] // 2, 0.5)
            gu.act = "silu_half"
        done = {}
        for norm, mat in (("attn_norm", "wqkv"), ("ffn_norm", "w_gate_up")):
            g, lin = getattr(L, norm, None), getattr(L, mat, None)
            if g is None or not isinstance(lin, DenseLinear) or (mat == "w_gate_up" and
                                                                 getattr(L, "moe", None) is not None):
                continue
            lin.scale_inputs(g)
            done[norm] = None
        w.layers[i] = L._replace(**done)
    if not w.tied and isinstance(w.head, BlockedLinear) and w.output_norm is not None:
        w.head.scale_inputs(w.output_norm)
        w.folded_output_norm, w.output_norm = w.output_norm, None


class TensorReader:
    """Reads one GGUF's tensors with shape checks: ``matrix`` (quantized rows), ``vector`` (float32)."""

    def __init__(self, gguf):
        self.gguf = gguf

    def has(self, name: str) -> bool:
        return name in self.gguf.tensors

    def matrix(self, name: str, shape: tuple[int, int], unpermute_heads: int = 0) -> QuantMatrix:
        """(out, in) quantized rows; ``unpermute_heads``: undo llama.cpp's interleaved-RoPE row order of Q/K
        (the same row shuffle works on quantized rows, whose blocks never cross a row)."""
        info = self.gguf.tensor(name)
        if tuple(info.shape) != shape:
            raise ValueError(f"tensor {name!r} has shape {tuple(info.shape)}, expected {shape}")
        layout = quants.block_layout(info.ggml_type)
        raw = info.data.reshape(shape[0], shape[1] // layout.block_size * layout.type_size)
        order = interleaved_to_half(np.arange(shape[0]), unpermute_heads) if unpermute_heads else None
        return QuantMatrix([(raw, info.ggml_type)], shape[1], [order])      # S21: the file is never copied

    def vector(self, name: str, n: int) -> np.ndarray:
        v = self.gguf.dequantize(name)
        if v.shape != (n,):
            raise ValueError(f"tensor {name!r} has shape {v.shape}, expected ({n},)")
        return v

    def stacked(self, name: str, shape: tuple[int, int, int]) -> tuple[np.ndarray, int]:
        """(raw uint8 (E, rows, row bytes), ggml_type) of a stacked (E, rows, cols) tensor (MoE experts). Older
        Mixtral files hold one tensor per expert (``blk.N.ffn_gate.E.weight`` for ``blk.N.ffn_gate_exps.weight``,
        as llama.cpp still reads them): those are stacked here."""
        if not self.has(name) and name.endswith("_exps.weight"):
            per = [f"{name[:-len('_exps.weight')]}.{e}.weight" for e in range(shape[0])]
            if self.has(per[0]):
                mats = [self.matrix(n, shape[1:]) for n in per]
                types = {m.parts[0][1] for m in mats}
                if len(types) > 1:
                    raise ValueError(f"tensors {per[0]!r}..{per[-1]!r} mix ggml types {sorted(types)}")
                return np.stack([m.parts[0][0] for m in mats]), types.pop()
        info = self.gguf.tensor(name)
        if tuple(info.shape) != shape:
            raise ValueError(f"tensor {name!r} has shape {tuple(info.shape)}, expected {shape} (experts, rows, "
                             "cols from the metadata)")
        layout = quants.block_layout(info.ggml_type)
        return info.data.reshape(shape[0], shape[1], shape[2] // layout.block_size * layout.type_size), \
            info.ggml_type


def moe_weights(r: TensorReader, prefix: str, c, mode: str) -> tuple[MoE, Linear | None, Linear | None]:
    """(MoE, shared gate|up, shared down) of one MoE layer in llama.cpp's names (S16); the shared expert's
    matrices are None when the file has none."""
    from pyengine.layers.linear import make_linear
    m, d = c.moe, c.d_model
    E, f = m.n_experts, m.expert_ffn
    router = r.matrix(prefix + "ffn_gate_inp.weight", (E, d)).dequantize().T.copy()
    experts = Experts(r.stacked(prefix + "ffn_gate_exps.weight", (E, f, d)),
                      r.stacked(prefix + "ffn_up_exps.weight", (E, f, d)),
                      r.stacked(prefix + "ffn_down_exps.weight", (E, d, f)), d, f, mode)
    bias = r.vector(prefix + "exp_probs_b.bias", E) if r.has(prefix + "exp_probs_b.bias") else None
    fs = m.shared_ffn
    if not fs and not r.has(prefix + "ffn_down_shexp.weight"):
        return MoE(router, experts, bias), None, None
    if not fs:
        raise ValueError(f"tensor {prefix + 'ffn_down_shexp.weight'!r} is present but the metadata has no "
                         f"'{c.arch}.expert_shared_feed_forward_length'")
    gate_up = QuantMatrix.stack(r.matrix(prefix + "ffn_gate_shexp.weight", (fs, d)),
                                r.matrix(prefix + "ffn_up_shexp.weight", (fs, d)))
    name = prefix + "ffn_gate_inp_shexp.weight"
    g = r.gguf.dequantize(name)
    if g.size != d or g.ndim > 2:
        raise ValueError(f"tensor {name!r} has shape {g.shape}, expected ({d},)")
    return (MoE(router, experts, bias, g.reshape(d)), make_linear(gate_up, mode, act="silu"),
            make_linear(r.matrix(prefix + "ffn_down_shexp.weight", (d, fs)), mode))


def qkv_matrix(r: TensorReader, prefix: str, c, unpermute: bool) -> QuantMatrix:
    """Q|K|V of one layer stacked into one matrix; ``unpermute``: undo llama.cpp's interleaved-RoPE row order of
    Q and K (llama GGUFs; Gemma's are stored in the half-split order already)."""
    hd, d = c.head_dim, c.d_model
    return QuantMatrix.stack(r.matrix(prefix + "attn_q.weight", (c.n_heads * hd, d), c.n_heads * unpermute),
                             r.matrix(prefix + "attn_k.weight", (c.n_kv_heads * hd, d), c.n_kv_heads * unpermute),
                             r.matrix(prefix + "attn_v.weight", (c.n_kv_heads * hd, d)))


def gate_up_matrix(r: TensorReader, prefix: str, c) -> QuantMatrix:
    """gate|up of one layer's gated MLP stacked into one matrix."""
    return QuantMatrix.stack(r.matrix(prefix + "ffn_gate.weight", (c.ffn_dim, c.d_model)),
                             r.matrix(prefix + "ffn_up.weight", (c.ffn_dim, c.d_model)))


def embedding_and_head(r: TensorReader, c, mode: str):
    """(embedding, head, tied): the head is output.weight, or the embedding itself when the file has none."""
    from pyengine.layers.linear import make_head
    embd = r.matrix("token_embd.weight", (c.vocab_size, c.d_model))
    tied = not r.has("output.weight")
    head = make_head(embd if tied else r.matrix("output.weight", (c.vocab_size, c.d_model)), mode)
    if tied:
        return Embedding(head, c.d_model), head, True
    # untied: resident keeps a float32 (d, V) array, lean the quantized rows
    return Embedding(np.ascontiguousarray(embd.dequantize().T) if mode == "resident" else embd, c.d_model), head, False


class TransformerModel:
    """The shared fast path. Subclasses set ``kinds`` / ``kind_of`` and define ``layer`` (one layer's math) and
    ``forward_reference``; ``embed_scale`` (Gemma: sqrt(d)) multiplies the embeddings; Granite's
    ``residual_scale`` multiplies each sub-layer's output before its residual add and ``logit_scale`` divides
    the logits; Gemma 2's ``final_softcap`` caps them."""
    embed_scale: float | None = None
    residual_scale: float | None = None
    logit_scale: float | None = None
    final_softcap: float | None = None     # Gemma 2: logits = c * tanh(logits / c)
    # S17: how tensor parallelism splits each field of this architecture's layers (parallel/shard.py
    # SPLIT_KINDS: "qkv", "heads_rows", "gate_up", "ffn_rows", "replicate", ...); every model class declares it
    tp_split: dict | None = None

    def __init__(self, config, weights: Weights, kinds: list[LayerKind], kind_of: list[int], scale: float):
        self.config, self.weights = config, weights
        self.kinds, self.kind_of, self.scale = kinds, kind_of, scale
        moe_layers = [i for i, L in enumerate(weights.layers) if getattr(L, "moe", None) is not None]
        if moe_layers:
            self.expert_load = ExpertLoad(moe_layers, config.moe.n_experts)

    @property
    def windows(self) -> list:
        return [k.window for k in self.kinds]

    def prepare(self, b: Buffers) -> None:
        """Fill the RoPE tables (once: positions 0 .. max_model_len-1)."""
        for kind, (tcos, tsin) in zip(self.kinds, b.rope_tables):
            cos, sin = kind.cos_sin(np.arange(tcos.shape[0]))
            tcos[...], tsin[...] = cos, sin

    def forward(self, plan, kv, b: Buffers, ops: EagerOps = EAGER) -> np.ndarray:
        """Logits (len(plan.logits_indices), V): a view of b.logits valid until the next call (a new array if more
        rows are asked than were planned). ``b``: the buffers cut to this step's T rows; ``ops``: run now, or
        also recorded (S13). S17's pipeline stages call the three parts on their own: embed (first stage),
        layers, logits (of rows sent back to it)."""
        self.embed(plan.token_ids, b.x, ops)
        self.run_layers(plan, kv, b, ops)
        return self.logits(b.x, plan.logits_indices, b, ops=ops)

    def embed(self, token_ids: np.ndarray, x: np.ndarray, ops: EagerOps = EAGER) -> None:
        ops.call(self.weights.embed, token_ids, x)
        if self.embed_scale is not None:
            ops.call(np.multiply, x, np.float32(self.embed_scale), x)

    def run_layers(self, plan, kv, b: Buffers, ops: EagerOps = EAGER) -> None:
        for i, L in enumerate(self.weights.layers):
            self.layer(i, L, plan.kinds[self.kind_of[i]], plan.slots, kv, b, ops)

    def logits(self, x: np.ndarray, idx: np.ndarray, b: Buffers, first: int = 0, ops: EagerOps = EAGER) -> np.ndarray:
        """Logits of rows ``idx`` of x, in b.logits[first:first + len(idx)] (allocated if more than planned)."""
        c, w = self.config, self.weights
        n, end = len(idx), first + len(idx)
        if end <= b.logits.shape[0]:
            hx, hxn, logits = b.logits_x[first:end], b.logits_xn[first:end], b.logits[first:end]
        else:   # more rows than planned (e.g. prompt logprobs): rare, so allocate rather than fail
            hx, hxn = np.empty((n, c.d_model), np.float32), np.empty((n, c.d_model), np.float32)
            logits = np.empty((n, c.vocab_size), np.float32)
        ops.call(np.take, x, idx, 0, hx)
        ops.rms_norm(hx, w.output_norm, c.rms_eps, hxn)
        ops.matmul(w.head, hxn, logits)
        if w.head_bias is not None:
            ops.call(np.add, logits, w.head_bias, logits)
        if self.final_softcap:                    # Gemma 2: c * tanh(logits / c)
            ops.call(cap_scores, logits, self.final_softcap)
        if self.logit_scale is not None:
            ops.call(np.divide, logits, np.float32(self.logit_scale), logits)
        return logits

    def logit_columns(self, x: np.ndarray) -> tuple[int, np.ndarray]:
        """S19 under S17: (first id, this rank's columns of the logits of rows ``x``) — as ``logits`` computes
        them, with a vocab-parallel head's own columns only (its ``columns``: not gathered)."""
        c, w = self.config, self.weights
        v0, logits = w.head.columns(rms_norm(x, w.output_norm, c.rms_eps))
        if w.head_bias is not None:
            logits += w.head_bias[v0:v0 + logits.shape[1]]
        if self.final_softcap:
            cap_scores(logits, self.final_softcap)
        if self.logit_scale is not None:
            np.divide(logits, np.float32(self.logit_scale), logits)
        return v0, logits

    def final_hidden(self, x: np.ndarray, idx: np.ndarray) -> np.ndarray:
        """S19: rows ``idx`` of the final residual stream ``x`` after the final norm (its weight even when folded
        into the head): the hidden state the LM head reads, a new (len(idx), d) float32 array."""
        w = self.weights
        g = w.output_norm if w.output_norm is not None else w.folded_output_norm
        return rms_norm(np.take(x, idx, axis=0), g, self.config.rms_eps)

    def add_residual(self, b: Buffers, ops: EagerOps = EAGER) -> None:
        """b.x += b.proj (times ``residual_scale``, if any), in place."""
        if self.residual_scale is not None:
            ops.call(np.multiply, b.proj, np.float32(self.residual_scale), b.proj)
        ops.call(np.add, b.x, b.proj, b.x)

    def layer(self, i: int, L, p, slots: np.ndarray, kv, b: Buffers, ops: EagerOps = EAGER) -> None:
        raise NotImplementedError

    def qk_norm_attention(self, i: int, L, p, slots: np.ndarray, kv, b: Buffers, whole: bool = False,
                          ops: EagerOps = EAGER) -> None:
        """b.proj = Wo · attention of b.x with RMSNorm of the queries and keys before RoPE (layer fields
        attn_norm, wqkv, q_norm, k_norm, wo): of each head (Gemma 3, Qwen3-MoE) or, ``whole``, of all query
        and all key columns at once (OLMoE)."""
        c = self.config
        H, Hkv, hd, eps = c.n_heads, c.n_kv_heads, c.head_dim, c.rms_eps
        T = b.x.shape[0]
        ops.rms_norm(b.x, L.attn_norm, eps, b.xn)
        ops.matmul(L.wqkv, b.xn, b.qkv)
        if whole:
            qk, out = b.qkv[:, :(H + Hkv) * hd], b.qk.reshape(T, (H + Hkv) * hd)
            if self.split_norm is not None:     # S17: this rank's heads only; the statistic is the ranks' sum
                ops.call(self.split_norm, qk[:, :H * hd], qk[:, H * hd:], L.q_norm, L.k_norm, eps,
                         out[:, :H * hd], out[:, H * hd:])
            else:
                ops.rms_norm(qk[:, :H * hd], L.q_norm, eps, out[:, :H * hd])
                ops.rms_norm(qk[:, H * hd:], L.k_norm, eps, out[:, H * hd:])
        else:
            qk = b.qkv[:, :(H + Hkv) * hd].reshape(T, H + Hkv, hd)
            ops.rms_norm(qk[:, :H], L.q_norm, eps, b.qk[:, :H])
            ops.rms_norm(qk[:, H:], L.k_norm, eps, b.qk[:, H:])
        ops.rope(b.qk, p.cos, p.sin, b.qk_rot, b.rope_tmp)
        ops.call(kv.write, i, slots, b.qk_rot[:, H:], b.qkv[:, (H + Hkv) * hd:].reshape(T, Hkv, hd))
        ops.attention(i, b.qk_rot[:, :H], kv, p.attention, b.attn, b, self.scale)
        ops.matmul(L.wo, b.attn.reshape(T, H * hd), b.proj)

    expert_load = None          # MoE models: an ExpertLoad (S16) the fast path counts routed tokens into
    split_norm = None           # S17 (parallel/shard.py): OLMoE's whole-projection q/k norm over tensor ranks

    def feed_forward(self, i: int, L, b: Buffers, ops: EagerOps = EAGER) -> None:
        """b.proj = the feed-forward of b.xn: the gated MLP, or an MoE layer's experts (layer fields ``moe``,
        ``w_gate_up`` / ``w_down`` then being its shared expert's, or None). A captured step (S13) replays an
        MoE layer as one call: which experts run, on how many rows, changes with every step's routing."""
        if getattr(L, "moe", None) is None:
            ops.gated(L.w_gate_up, b.xn, b.ffn, b.gate_up)
            ops.matmul(L.w_down, b.ffn, b.proj)
        else:
            ops.call(self.moe_feed_forward, i, L, b.xn, b.proj, b.moe)

    def moe_feed_forward(self, i: int, L, xn: np.ndarray, out: np.ndarray, scratch: MoEScratch) -> None:
        counts = moe_forward(L.moe, self.config.moe, xn, out, scratch, L.w_gate_up, L.w_down)
        if self.expert_load is not None:
            self.expert_load.add(i, counts)

    def ffn_reference(self, L, xn: np.ndarray) -> np.ndarray:
        """The readable feed-forward (``forward_reference``): gated MLP, or the MoE per token."""
        moe = getattr(L, "moe", None)
        if moe is None:
            return gated_activation(xn @ L.w_gate_up, L.w_gate_up.act) @ L.w_down
        return moe_reference(moe, self.config.moe, xn, L.w_gate_up, L.w_down)
