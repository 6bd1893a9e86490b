// Public API of ts-mini (Python counterpart: pyengine/llm.py LLM).
//
//   const engine = loadModel(arrayBuffer);                 // parse GGUF in place, carve the arena
//   const ids = engine.encode("Hello");                     // byte-level BPE
//   const r = engine.generate("Hello", { maxTokens: 32 }, (id, text) => process.stdout.write(text));

import { GGUFError } from "./02_gguf_header.js";
import { GGUFFile, isBuffer, parseGGUF } from "./04_tensor_table.js";
import { MatmulPool, canShareMemory, toShared } from "./13b_matmul_pool.js";
import { SimdKernels, simdAvailable } from "./13c_simd.js";
import { Vocab, readVocab, tokenBytes } from "./08_vocab.js";
import { BPEEncoder, ChatMessage, applyChatTemplate } from "./09_bpe_encode.js";
import { Utf8Stream } from "./10_utf8_stream.js";
import {
  FinishReason, GenerateOptions, Generation, LlamaConfig, LlamaModel, ModelOptions, readConfig,
} from "./18_generate.js";

export { GGUFError } from "./02_gguf_header.js";
export { parseGGUF } from "./04_tensor_table.js";
export { joinSplit, splitPartNames } from "./04b_split.js";
export type { GGUFFile, TensorInfo } from "./04_tensor_table.js";
export { Utf8Stream } from "./10_utf8_stream.js";
export { LlamaModel, Generation } from "./18_generate.js";
export { Pcg64, lawExp, sample, streamFor, checkSamplingOptions } from "./17_sampler.js";
export type { SamplingOptions, SamplerScratch } from "./17_sampler.js";
export { MatmulPool, canShareMemory } from "./13b_matmul_pool.js";
export { SimdKernels, simdAvailable } from "./13c_simd.js";
export type { GenerateOptions, FinishReason, LlamaConfig, ModelOptions } from "./18_generate.js";
export type { ChatMessage } from "./09_bpe_encode.js";

export interface LoadOptions extends ModelOptions {
  onProgress?: (stage: string, loaded: number, total: number) => void;
  byteLength?: number; // the file's size when the buffer holds more (a memory from SimdKernels.reserve)
}

export interface ThreadedLoadOptions extends LoadOptions {
  threads?: number; // matmul threads, this one included (default: navigator.hardwareConcurrency, else 1)
}

export interface GenerateRequest extends GenerateOptions {
  chat?: boolean; // wrap a text prompt in the model's chat template
  skipSpecialTokens?: boolean; // leave special tokens (e.g. <|im_end|>) out of the text (default true)
}

export interface GenerateResult {
  tokenIds: number[];
  text: string;
  finishReason: FinishReason;
  promptTokens: number;
  prefillMs: number;
  decodeMs: number;
  tokensPerSecond: number; // decode speed: tokens after the first / time after the first
}

/** (tokenId, textDelta) for each token; return false to stop generating (finishReason "abort"). */
export type OnToken = (tokenId: number, text: string) => boolean | void;

export class Engine {
  readonly gguf: GGUFFile;
  /** Threads the products run on (1 unless loaded by loadModelThreaded with a pool). */
  threads = 1;
  /** Why the engine runs on fewer threads than asked, if it does (e.g. not cross-origin isolated). */
  threadNote: string | null = null;
  private pool: MatmulPool | null = null;
  readonly vocab: Vocab;
  readonly model: LlamaModel;
  private readonly encoder: BPEEncoder;
  private readonly specialIds: Set<number>;

  constructor(gguf: GGUFFile, vocab: Vocab, model: LlamaModel) {
    this.gguf = gguf;
    this.vocab = vocab;
    this.model = model;
    this.encoder = new BPEEncoder(vocab);
    this.specialIds = new Set(vocab.special.map((s) => vocab.ids.get(s)!));
  }

  get config(): LlamaConfig {
    return this.model.config;
  }

  /** Text -> ids, without adding BOS/EOS; special tokens written in the text are recognised. */
  encode(text: string, parseSpecial = true): number[] {
    return this.encoder.encode(text, parseSpecial);
  }

  decode(ids: number[], skipSpecialTokens = false): string {
    const s = new Utf8Stream();
    let out = "";
    for (const id of ids) if (!(skipSpecialTokens && this.specialIds.has(id))) out += s.add(tokenBytes(this.vocab, id));
    return out + s.flush();
  }

  /** Run the products on `pool` (loadModelThreaded does this). */
  attachPool(pool: MatmulPool): void {
    this.pool = pool;
    this.threads = pool.threads;
    this.model.setPool(pool);
  }

  /** Stop the worker threads, if any (the engine keeps working on one thread). */
  close(): void {
    if (!this.pool) return;
    this.model.setPool(null);
    this.pool.close();
    this.pool = null;
    this.threads = 1;
  }

  /** Control/user-defined tokens (e.g. <|im_end|>): left out of streamed text. */
  isSpecial(id: number): boolean {
    return this.specialIds.has(id);
  }

  tokenBytes(id: number): Uint8Array {
    return tokenBytes(this.vocab, id);
  }

  applyChatTemplate(messages: ChatMessage[], addGenerationPrompt = true): string {
    return applyChatTemplate(this.vocab, messages, addGenerationPrompt);
  }

  promptIds(prompt: string | number[], chat = false): number[] {
    if (typeof prompt !== "string") return prompt;
    return this.encode(chat ? this.applyChatTemplate([{ role: "user", content: prompt }]) : prompt);
  }

  /** Start a step-wise generation (the worker uses this to yield between tokens). */
  start(prompt: string | number[], opts: GenerateRequest = {}): Generation {
    return new Generation(this.model, this.promptIds(prompt, opts.chat), opts, this.vocab.stopIds);
  }

  /** Generate to completion, calling onToken with each token's id and the text it completes. */
  generate(prompt: string | number[], opts: GenerateRequest = {}, onToken?: OnToken): GenerateResult {
    const ids = this.promptIds(prompt, opts.chat);
    const gen = new Generation(this.model, ids, opts, this.vocab.stopIds);
    const stream = new Utf8Stream();
    const skip = opts.skipSpecialTokens ?? true;
    let text = "", t0 = performance.now(), tFirst = t0;
    for (let id = gen.step(); id !== null; id = gen.step()) {
      if (gen.tokenIds.length === 1) tFirst = performance.now();
      const delta = skip && this.specialIds.has(id) ? "" : stream.add(tokenBytes(this.vocab, id));
      text += delta;
      if (onToken && onToken(id, delta) === false) gen.abort();
    }
    text += stream.flush();
    const end = performance.now(), n = gen.tokenIds.length;
    return {
      tokenIds: gen.tokenIds, text, finishReason: gen.finishReason!, promptTokens: ids.length,
      prefillMs: tFirst - t0, decodeMs: end - tFirst, tokensPerSecond: n > 1 ? ((n - 1) * 1000) / (end - tFirst) : 0,
    };
  }
}

/** Parse a GGUF (kept in place: weights are read from `buffer`), build the tokenizer and the arena. */
export function loadModel(buffer: ArrayBufferLike, opts: LoadOptions = {}): Engine {
  if (!isBuffer(buffer)) throw new GGUFError("loadModel expects an ArrayBuffer holding a GGUF file");
  const p = opts.onProgress ?? (() => {});
  const total = 3;
  p("parse", 0, total);
  const gguf = parseGGUF(buffer, opts.byteLength ?? buffer.byteLength);
  readConfig(gguf); // fail early (before the tokenizer and the arena) on a model we cannot run
  p("tokenizer", 1, total);
  const vocab = readVocab(gguf.metadata);
  p("arena", 2, total);
  const model = new LlamaModel(gguf, opts);
  if (vocab.tokens.length !== model.config.vocabSize) {
    throw new GGUFError(`vocabulary has ${vocab.tokens.length} tokens but token_embd has ${model.config.vocabSize} rows`);
  }
  p("ready", 3, total);
  return new Engine(gguf, vocab, model);
}

/** Default thread count: the platform's core count (navigator.hardwareConcurrency), else 1. */
export function defaultThreads(): number {
  const n = (globalThis as { navigator?: { hardwareConcurrency?: number } }).navigator?.hardwareConcurrency;
  return Number.isInteger(n) && n! > 0 ? n! : 1;
}

/**
 * loadModel on `threads` threads: the GGUF is copied into a SharedArrayBuffer (unless it is one; with the SIMD
 * kernels of 13c, into their shared WebAssembly.Memory, whose buffer is one), the arena is
 * shared, and a MatmulPool of threads-1 helpers splits every product by rows. Where memory cannot be shared
 * (a page that is not cross-origin isolated) or a helper cannot start, the engine runs on one thread and
 * `threadNote` says why. Call engine.close() to stop the helpers.
 */
export async function loadModelThreaded(buffer: ArrayBufferLike, opts: ThreadedLoadOptions = {}): Promise<Engine> {
  const threads = opts.threads ?? defaultThreads();
  if (!Number.isInteger(threads) || threads < 1) throw new RangeError(`threads must be an integer >= 1, got ${threads}`);
  if (threads === 1) return loadModel(buffer, opts);
  if (!canShareMemory()) {
    const e = loadModel(buffer, opts);
    e.threadNote = "one thread: SharedArrayBuffer needs a cross-origin isolated page (COOP/COEP headers)";
    return e;
  }
  if (!isBuffer(buffer)) throw new GGUFError("loadModel expects an ArrayBuffer holding a GGUF file");
  // with SIMD kernels (13c) the model copies the GGUF into their shared memory itself
  const simd = opts.simd !== false && simdAvailable();
  const e = loadModel(simd ? buffer : toShared(buffer), { ...opts, sharedArena: true });
  const c = e.config, maxIn = Math.max(c.dModel, c.nHeads * c.headDim, c.ffnDim);
  try {
    e.attachPool(await MatmulPool.start(threads, e.gguf.buffer as SharedArrayBuffer, e.model.arena.buffer as SharedArrayBuffer,
      e.model.w, maxIn, e.model.simd?.spec ?? null));
  } catch (err) {
    e.threadNote = `one thread: the matmul workers did not start (${err instanceof Error ? err.message : String(err)})`;
  }
  return e;
}

/**
 * loadModelThreaded for a Blob (a File, or the body of a stored Response): its bytes are read straight into the
 * memory the SIMD kernels then use (SimdKernels.reserve), so the file is neither held twice nor copied (without
 * SIMD: into an ArrayBuffer). A revisit's model comes from the page's store this way (web/model_store.js).
 */
export async function loadModelFromBlob(blob: Blob, opts: ThreadedLoadOptions = {}): Promise<Engine> {
  const threads = opts.threads ?? defaultThreads();
  if (!Number.isInteger(threads) || threads < 1) throw new RangeError(`threads must be an integer >= 1, got ${threads}`);
  const into = opts.simd !== false && simdAvailable() ? SimdKernels.reserve(blob.size, threads > 1 && canShareMemory())
    : new Uint8Array(blob.size);
  const reader = blob.stream().getReader();
  let at = 0, told = 0;
  for (;;) {
    const { done, value } = await reader.read();
    if (done) break;
    if (at + value.byteLength > into.length) throw new GGUFError(`the model file has more than its ${into.length} bytes`);
    into.set(value, at);
    at += value.byteLength;
    if (at - told >= into.length / 16 || at === into.length) opts.onProgress?.("read", (told = at), into.length);
  }
  if (at !== into.length) throw new GGUFError(`read ${at} of the model file's ${into.length} bytes`);
  return loadModelThreaded(into.buffer, { ...opts, threads, byteLength: blob.size });
}
