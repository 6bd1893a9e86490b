// Step 18 — the model and the generation loop (Python: pyengine/config.py ModelConfig, pyengine/models/llama.py
// LlamaWeights/LlamaModel.forward, pyengine/llm.py generate, pyengine/engine/stop_checker.py).
//
// forward(tokens, pos0) runs a chunk of T tokens through all layers and returns the logits of the last one:
//   x = embed(tokens)
//   per layer:  x += Wo · attention(rope(Wq·norm(x)), rope(Wk·norm(x)), Wv·norm(x))
//               x += Wdown · swiglu(Wgate·norm(x), Wup·norm(x))
//   logits = Wout · norm(x_last)
// Generation = forward(prompt) in chunks, then one token at a time: sample, stream its bytes, feed it back.

import { GGUFError } from "./02_gguf_header.js";
import { metaNumber, metaString } from "./03_metadata.js";
import { GGMLType, GGUFFile, TensorInfo, tensor } from "./04_tensor_table.js";
import { Arena, ArenaLayout } from "./01_arena.js";
import { WeightViews, fillHalfTable, makeWeightViews } from "./05_f16_bf16.js";
import { embed, rmsnorm } from "./11_embed_rmsnorm.js";
import { applyRope, fillRopeTables } from "./12_rope.js";
import { MatScratch, RowSplitter, checkSupported, matmul } from "./13_matmul.js";
import { SimdKernels, simdAvailable } from "./13c_simd.js";
import { LUT_MAX_IN } from "./06_q8_q4_dot.js";
import { KVCache, attend, storeKV } from "./14_attention.js";
import { addInPlace, swiglu } from "./15_swiglu.js";
import { computeLogits } from "./16_logits.js";
import { Pcg64, SamplerScratch, SamplingOptions, checkSamplingOptions, sample, streamFor } from "./17_sampler.js";

// ---- configuration (pyengine/config.py) ----

export interface LlamaConfig {
  arch: string;
  nLayers: number;
  dModel: number;
  nHeads: number;
  nKvHeads: number;
  headDim: number;
  ffnDim: number;
  vocabSize: number;
  contextLength: number;
  ropeTheta: number;
  ropeScale: number; // linear position scaling (1 = none)
  rmsEps: number;
  tieEmbeddings: boolean;
}

export function readConfig(g: GGUFFile): LlamaConfig {
  const md = g.metadata;
  const arch = metaString(md, "general.architecture");
  if (arch !== "llama") throw new GGUFError(`ts-mini runs llama-architecture models, this file is "${arch}"`);
  const k = (name: string, fallback?: number) => metaNumber(md, `${arch}.${name}`, fallback);
  const dModel = k("embedding_length"), nHeads = k("attention.head_count");
  const nKvHeads = k("attention.head_count_kv", nHeads);
  const headDim = k("attention.key_length", dModel / nHeads);
  if (!Number.isInteger(headDim) || headDim % 2 !== 0) throw new GGUFError(`bad head dim ${headDim}`);
  if (nHeads % nKvHeads !== 0) throw new GGUFError(`head_count ${nHeads} is not a multiple of head_count_kv ${nKvHeads}`);
  const scaling = metaString(md, `${arch}.rope.scaling.type`, "none");
  if (scaling !== "none" && scaling !== "linear") throw new GGUFError(`rope scaling "${scaling}" is not supported by ts-mini`);
  const embd = tensor(g, "token_embd.weight");
  return {
    arch, nLayers: k("block_count"), dModel, nHeads, nKvHeads, headDim, ffnDim: k("feed_forward_length"),
    vocabSize: embd.rows, contextLength: k("context_length", 2048), ropeTheta: k("rope.freq_base", 10000),
    ropeScale: scaling === "linear" ? k("rope.scaling.factor", 1) : 1,
    rmsEps: k("attention.layer_norm_rms_epsilon", 1e-5), tieEmbeddings: !g.tensors.has("output.weight"),
  };
}

// ---- weights: tensor handles into the GGUF buffer (pyengine/models/llama.py LlamaWeights) ----

interface LayerWeights {
  attnNorm: Float32Array; wq: TensorInfo; wk: TensorInfo; wv: TensorInfo; wo: TensorInfo;
  ffnNorm: Float32Array; gate: TensorInfo; up: TensorInfo; down: TensorInfo;
}
interface LlamaWeights { embed: TensorInfo; layers: LayerWeights[]; outputNorm: Float32Array; output: TensorInfo }

function matrix(g: GGUFFile, name: string, rows: number, cols: number): TensorInfo {
  const t = tensor(g, name);
  if (t.rows !== rows || t.rowLength !== cols) throw new GGUFError(`tensor "${name}" is [${t.shape}], expected [${rows}, ${cols}]`);
  checkSupported(t);
  return t;
}

/** A norm weight: a zero-copy Float32Array view of an F32 tensor. */
function vector(g: GGUFFile, name: string, n: number): Float32Array {
  const t = tensor(g, name);
  if (t.type !== GGMLType.F32 || t.rowLength * t.rows !== n) throw new GGUFError(`tensor "${name}" must be F32 of ${n} elements`);
  return new Float32Array(g.buffer, t.offset, n);
}

function bindWeights(g: GGUFFile, c: LlamaConfig): LlamaWeights {
  const d = c.dModel, qDim = c.nHeads * c.headDim, kvDim = c.nKvHeads * c.headDim;
  const layers: LayerWeights[] = [];
  for (let l = 0; l < c.nLayers; l++) {
    const p = `blk.${l}.`;
    layers.push({
      attnNorm: vector(g, p + "attn_norm.weight", d),
      wq: matrix(g, p + "attn_q.weight", qDim, d), wk: matrix(g, p + "attn_k.weight", kvDim, d),
      wv: matrix(g, p + "attn_v.weight", kvDim, d), wo: matrix(g, p + "attn_output.weight", d, qDim),
      ffnNorm: vector(g, p + "ffn_norm.weight", d),
      gate: matrix(g, p + "ffn_gate.weight", c.ffnDim, d), up: matrix(g, p + "ffn_up.weight", c.ffnDim, d),
      down: matrix(g, p + "ffn_down.weight", d, c.ffnDim),
    });
  }
  const embedT = matrix(g, "token_embd.weight", c.vocabSize, d);
  const output = c.tieEmbeddings ? embedT : matrix(g, "output.weight", c.vocabSize, d);
  return { embed: embedT, layers, outputNorm: vector(g, "output_norm.weight", d), output };
}

// ---- the model: weights + one arena of runtime state ----

export interface ModelOptions {
  maxSeqLen?: number; // KV cache length (default min(context_length, 2048))
  prefillChunk?: number; // tokens per prefill matmul (default 32)
  sharedArena?: boolean; // arena in a SharedArrayBuffer (needed by a matmul worker pool, 13b)
  simd?: boolean; // Q4_1/Q8_0 matvecs in WebAssembly SIMD where available (13c; default true): the GGUF moves into its memory
}

export class LlamaModel {
  readonly config: LlamaConfig;
  readonly gguf: GGUFFile;
  readonly arena: Arena;
  readonly maxSeq: number;
  readonly chunk: number;
  readonly w: WeightViews; // views over the GGUF buffer (the pool's main thread reads the weights through them)
  readonly simd: SimdKernels | null; // the SIMD kernels, whose memory then holds the GGUF (g.buffer points there)
  private readonly weights: LlamaWeights;
  private readonly cache: KVCache;
  private readonly ropeCos: Float32Array;
  private readonly ropeSin: Float32Array;
  private readonly x: Float32Array; private readonly xb: Float32Array; private readonly proj: Float32Array;
  private readonly q: Float32Array; private readonly k: Float32Array; private readonly v: Float32Array;
  private readonly att: Float32Array; private readonly gate: Float32Array; private readonly up: Float32Array;
  private readonly scores: Float64Array; private readonly acc: Float64Array;
  private readonly mat: MatScratch;
  readonly logits: Float32Array;
  readonly samplerScratch: SamplerScratch;

  constructor(g: GGUFFile, opts: ModelOptions = {}) {
    const c = (this.config = readConfig(g));
    this.gguf = g;
    this.weights = bindWeights(g, c);
    const maxSeqLen = opts.maxSeqLen ?? 2048, chunk = opts.prefillChunk ?? 32;
    if (!Number.isInteger(maxSeqLen) || maxSeqLen < 1) throw new RangeError(`maxSeqLen must be a positive integer, got ${maxSeqLen}`);
    if (!Number.isInteger(chunk) || chunk < 1) throw new RangeError(`prefillChunk must be a positive integer, got ${chunk}`);
    this.maxSeq = Math.min(maxSeqLen, c.contextLength);
    this.chunk = chunk;
    const P = this.chunk, d = c.dModel, qDim = c.nHeads * c.headDim, kvDim = c.nKvHeads * c.headDim;
    const maxIn = Math.max(d, qDim, c.ffnDim), V = c.vocabSize, half = c.headDim / 2;

    const L = new ArenaLayout()
      .add("half", "f32", 65536)
      .add("rope_cos", "f32", this.maxSeq * half).add("rope_sin", "f32", this.maxSeq * half)
      .add("k_cache", "f32", c.nLayers * this.maxSeq * kvDim).add("v_cache", "f32", c.nLayers * this.maxSeq * kvDim)
      .add("x", "f32", P * d).add("xb", "f32", P * maxIn).add("proj", "f32", P * d)
      .add("q", "f32", P * qDim).add("k", "f32", P * kvDim).add("v", "f32", P * kvDim).add("att", "f32", P * qDim)
      .add("gate", "f32", P * c.ffnDim).add("up", "f32", P * c.ffnDim)
      .add("logits", "f32", V)
      .add("mat_xs", "f64", maxIn).add("mat_xsum", "f64", Math.ceil(maxIn / 32)).add("mat_row", "f32", 2 * maxIn)
      .add("mat_xq", "i32", maxIn).add("mat_xd", "f64", Math.ceil(maxIn / 32))
      .add("mat_lut", "i32", (Math.min(maxIn, LUT_MAX_IN) >> 5) * 4096)
      .add("scores", "f64", this.maxSeq).add("acc", "f64", c.headDim)
      .add("sample_probs", "f64", V).add("sample_idx", "i32", V).add("sample_vals", "f64", V);
    const a = (this.arena = new Arena(L, !!opts.sharedArena));
    this.simd = null;
    if (opts.simd !== false && simdAvailable()) {
      this.simd = SimdKernels.create(g.buffer, maxIn, Math.max(V, c.ffnDim, d, qDim, kvDim), !!opts.sharedArena, g.byteLength);
      g.buffer = this.simd.buffer; // same bytes at the same offsets
    }

    this.w = makeWeightViews(g.buffer, fillHalfTable(a.f32("half")));
    this.ropeCos = a.f32("rope_cos");
    this.ropeSin = a.f32("rope_sin");
    fillRopeTables(this.ropeCos, this.ropeSin, this.maxSeq, c.headDim, c.ropeTheta, c.ropeScale);
    this.cache = { k: a.f32("k_cache"), v: a.f32("v_cache"), maxSeq: this.maxSeq, kvDim };
    this.x = a.f32("x"); this.xb = a.f32("xb"); this.proj = a.f32("proj");
    this.q = a.f32("q"); this.k = a.f32("k"); this.v = a.f32("v"); this.att = a.f32("att");
    this.gate = a.f32("gate"); this.up = a.f32("up");
    this.logits = a.f32("logits");
    this.mat = { xs: a.f64("mat_xs"), xsum: a.f64("mat_xsum"), row: a.f32("mat_row"), xq: a.i32("mat_xq"), xd: a.f64("mat_xd"), lut: a.i32("mat_lut"),
      simd: this.simd };
    this.scores = a.f64("scores"); this.acc = a.f64("acc");
    this.samplerScratch = { probs: a.f64("sample_probs"), idx: a.i32("sample_idx"), vals: a.f64("sample_vals") };
  }

  /** Split the products of this model over a worker pool (13b_matmul_pool.ts); null: back to one thread. */
  setPool(pool: RowSplitter | null): void {
    this.mat.pool = pool;
  }

  /**
   * Run tokens[start .. start+T) at positions pos0 .. pos0+T-1 (T <= chunk), writing their K/V into the
   * cache, and return the logits of the last one (a view into the arena, valid until the next call).
   */
  forward(tokens: ArrayLike<number>, start: number, T: number, pos0: number): Float32Array {
    const c = this.config, W = this.weights, w = this.w, s = this.mat;
    const d = c.dModel, hd = c.headDim, qDim = c.nHeads * hd, kvDim = c.nKvHeads * hd, F = c.ffnDim;
    if (T < 1 || T > this.chunk) throw new RangeError(`forward: T=${T} must be in 1..${this.chunk}`);
    if (pos0 + T > this.maxSeq) throw new RangeError(`forward: position ${pos0 + T - 1} exceeds maxSeqLen ${this.maxSeq}`);
    const { x, xb, q, k, v, att, proj, gate, up } = this;

    for (let t = 0; t < T; t++) embed(w, W.embed, tokens[start + t], x, t * d);
    for (let l = 0; l < c.nLayers; l++) {
      const Lw = W.layers[l];
      // attention block
      for (let t = 0; t < T; t++) rmsnorm(xb, t * d, x, t * d, Lw.attnNorm, d, c.rmsEps);
      matmul(w, Lw.wq, xb, T, q, s);
      matmul(w, Lw.wk, xb, T, k, s);
      matmul(w, Lw.wv, xb, T, v, s);
      for (let t = 0; t < T; t++) {
        applyRope(q, t * qDim, c.nHeads, hd, pos0 + t, this.ropeCos, this.ropeSin);
        applyRope(k, t * kvDim, c.nKvHeads, hd, pos0 + t, this.ropeCos, this.ropeSin);
        storeKV(this.cache, l, pos0 + t, k, t * kvDim, v, t * kvDim);
      }
      for (let t = 0; t < T; t++) {
        attend(att, t * qDim, q, t * qDim, this.cache, l, pos0 + t + 1, c.nHeads, c.nKvHeads, hd, this.scores, this.acc);
      }
      matmul(w, Lw.wo, att, T, proj, s);
      addInPlace(x, proj, T * d);
      // feed-forward block
      for (let t = 0; t < T; t++) rmsnorm(xb, t * d, x, t * d, Lw.ffnNorm, d, c.rmsEps);
      matmul(w, Lw.gate, xb, T, gate, s);
      matmul(w, Lw.up, xb, T, up, s);
      swiglu(gate, up, T * F);
      matmul(w, Lw.down, gate, T, proj, s);
      addInPlace(x, proj, T * d);
    }
    computeLogits(w, W.output, W.outputNorm, c.rmsEps, x, (T - 1) * d, xb, this.logits, s);
    return this.logits;
  }

  /** Feed a whole prompt (in chunks) starting at position pos0; returns the last token's logits. */
  prefill(tokens: ArrayLike<number>, pos0 = 0): Float32Array {
    if (tokens.length === 0) throw new RangeError("prefill: empty prompt");
    let logits = this.logits;
    for (let i = 0; i < tokens.length; i += this.chunk) {
      const T = Math.min(this.chunk, tokens.length - i);
      logits = this.forward(tokens, i, T, pos0 + i);
    }
    return logits;
  }
}

// ---- the generation loop (pyengine/llm.py generate + pyengine/engine/stop_checker.py, minus stop strings) ----

export interface GenerateOptions extends Partial<SamplingOptions> {
  maxTokens?: number; // default 64
  seed?: number; // default: random. The stream of docs/sampling.md: np.random.default_rng(seed)
  stopTokenIds?: number[]; // extra ids that end generation
  ignoreEos?: boolean; // keep going past end-of-sequence tokens (used to compare against golden greedy runs)
}

export type FinishReason = "stop" | "length" | "abort";

/** One generation, advanced one token per step() so a caller can yield (or cancel) between tokens. */
export class Generation {
  readonly tokenIds: number[] = [];
  finishReason: FinishReason | null = null;
  private readonly model: LlamaModel;
  private readonly opts: SamplingOptions;
  private readonly rng: Pcg64;
  private readonly maxTokens: number;
  private readonly stopIds: Set<number>;
  private pos: number;
  private logits: Float32Array | null = null;
  private readonly prompt: number[];

  constructor(model: LlamaModel, promptIds: number[], o: GenerateOptions, eosIds: Set<number>) {
    this.model = model;
    this.opts = {
      temperature: o.temperature ?? 0, topK: o.topK ?? 0, topP: o.topP ?? 1, minP: o.minP ?? 0,
      repetitionPenalty: o.repetitionPenalty ?? 1, presencePenalty: o.presencePenalty ?? 0,
      frequencyPenalty: o.frequencyPenalty ?? 0, logitBias: o.logitBias ?? null,
    };
    checkSamplingOptions(this.opts, model.config.vocabSize);
    this.maxTokens = o.maxTokens ?? 64;
    if (!Number.isInteger(this.maxTokens) || this.maxTokens < 0) throw new RangeError(`maxTokens must be an integer >= 0, got ${o.maxTokens}`);
    if (promptIds.length === 0) throw new RangeError("prompt is empty: need at least one token");
    const V = model.config.vocabSize;
    for (const id of promptIds) if (!Number.isInteger(id) || id < 0 || id >= V) throw new RangeError(`prompt token id ${id} out of range 0..${V - 1}`);
    if (promptIds.length >= model.maxSeq) throw new RangeError(`prompt has ${promptIds.length} tokens; maxSeqLen is ${model.maxSeq}`);
    if (o.seed != null && !(Number.isSafeInteger(o.seed) && o.seed >= 0)) throw new RangeError(`seed must be an integer >= 0 (the sampling law: NumPy's default_rng(seed)), got ${o.seed}`);
    this.rng = streamFor(o.seed ?? Math.floor(Math.random() * 2 ** 53));
    this.stopIds = new Set([...(o.ignoreEos ? [] : eosIds), ...(o.stopTokenIds ?? [])]);
    this.prompt = promptIds;
    this.pos = 0;
  }

  get done(): boolean {
    return this.finishReason !== null;
  }

  /** Produce the next token (running the prompt first on the first call). Returns null once finished. */
  step(): number | null {
    if (this.done) return null;
    if (this.tokenIds.length >= this.maxTokens) { this.finishReason = "length"; return null; }
    if (this.logits === null) {
      this.logits = this.model.prefill(this.prompt, 0);
      this.pos = this.prompt.length;
    } else {
      if (this.pos >= this.model.maxSeq) { this.finishReason = "length"; return null; }
      const last = this.tokenIds.length - 1;
      this.logits = this.model.forward(this.tokenIds, last, 1, this.pos);
      this.pos++;
    }
    const id = sample(this.logits, this.model.config.vocabSize, this.opts, this.rng, this.model.samplerScratch,
      this.prompt, this.tokenIds);
    this.tokenIds.push(id);
    if (this.stopIds.has(id)) this.finishReason = "stop";
    else if (this.tokenIds.length >= this.maxTokens) this.finishReason = "length";
    return id;
  }

  abort(): void {
    if (!this.done) this.finishReason = "abort";
  }
}
