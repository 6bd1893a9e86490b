// Web worker front end (the same protocol as the Pyodide worker, docs/architecture.md):
//   main -> worker  {type:"load", model: ArrayBuffer | ArrayBuffer[] (split GGUF parts) | Blob, maxSeqLen?, threads?}
//                   (a Blob, e.g. a stored model's body, is read straight into the SIMD kernels' memory: no copy)
//                   (maxSeqLen: KV cache length, default 2048; threads: matmul threads, default 1 — the page sends
//                   navigator.hardwareConcurrency)
//                   {type:"generate", id, prompt, maxTokens, temperature, topP, topK, minP, repetitionPenalty,
//                    presencePenalty, frequencyPenalty, logitBias, seed, chat, messages?}   (the sampling law:
//                    docs/sampling.md; the same seed and settings give the same tokens as the Python engine;
//                    messages: [{role, content}], the whole conversation in the chat template, replaces prompt)
//                   {type:"cancel", id}
//   worker -> main  {type:"progress", stage, loaded, total}  {type:"ready", info}
//                   {type:"token", id, tokenId, text, ms}     {type:"done", id, tokenIds, text, tokensPerSecond,
//                   finishReason, ttftMs}                     {type:"error", id?, message, modelKept?}
// `ms` is the time since the previous token (the first: since the request started, prefill included).
// Optional numbers may be null (= default). A failed load keeps the previous model (modelKept: true).
// `ready` info carries threads (the threads actually used) and threadNote (why fewer, e.g. no cross-origin
// isolation). With threads > 1 the file is checked synchronously, then the pool starts (async); requests sent
// meanwhile wait for it.
// Usage: new Worker(new URL("ts-mini/dist/worker.js", base), { type: "module" }).
// Generation runs one token per turn of the event loop, so a "cancel" posted meanwhile is seen before the
// next token. Requests are served one at a time, in arrival order.

import { ChatMessage, Engine, loadModel, loadModelFromBlob, loadModelThreaded } from "./index.js";
import { parseGGUF } from "./04_tensor_table.js";
import { joinSplit } from "./04b_split.js";
import { readConfig } from "./18_generate.js";
import { tokenBytes } from "./08_vocab.js";
import { Utf8Stream } from "./10_utf8_stream.js";

export type Post = (msg: Record<string, unknown>) => void;

interface GenerateMsg {
  type: "generate";
  id: string | number;
  prompt: string | number[];
  maxTokens?: number | null;
  temperature?: number | null;
  topP?: number | null;
  topK?: number | null;
  minP?: number | null;
  repetitionPenalty?: number | null;
  presencePenalty?: number | null;
  frequencyPenalty?: number | null;
  logitBias?: Record<number, number> | null;
  seed?: number | null;
  chat?: boolean;
  messages?: ChatMessage[]; // extension: the whole conversation in the chat template, in place of prompt
}

/** Resolve on a fresh macrotask (MessageChannel: no 4 ms clamp like nested setTimeout). */
function nextTurn(): Promise<void> {
  return new Promise((resolve) => {
    const ch = new MessageChannel();
    ch.port1.onmessage = () => {
      ch.port1.close();
      resolve();
    };
    ch.port2.postMessage(null);
  });
}

function message(e: unknown): string {
  return e instanceof Error ? e.message : String(e);
}

/** A conversation from the page: a non-empty list of {role: system|user|assistant, content: string}. */
function checkMessages(m: unknown): ChatMessage[] {
  if (!Array.isArray(m) || m.length === 0) throw new Error("messages must be a non-empty list of {role, content}");
  m.forEach((x, i) => {
    if (!x || !["system", "user", "assistant"].includes(x.role) || typeof x.content !== "string")
      throw new Error(`messages[${i}] must be {role: system|user|assistant, content: string}`);
  });
  return m as ChatMessage[];
}

/** The protocol state machine, independent of the worker global (so Node tests can drive it). */
export function createHandler(post: Post): (msg: unknown) => void {
  let engine: Engine | null = null;
  const queue: GenerateMsg[] = [];
  const cancelled = new Set<string | number>();
  let running = false;
  let current: string | number | null = null; // id of the request being generated
  let loading: Promise<void> | null = null; // a threaded load in progress

  async function runQueue(): Promise<void> {
    if (running) return;
    running = true;
    try {
      while (queue.length) {
        if (loading) await loading;
        const req = queue.shift()!;
        current = req.id;
        try {
          await generate(req);
        } catch (e) {
          post({ type: "error", id: req.id, message: message(e) });
        }
        current = null;
        cancelled.delete(req.id);
      }
    } finally {
      running = false;
    }
  }

  async function generate(req: GenerateMsg): Promise<void> {
    if (!engine) throw new Error("no model loaded: send {type:'load', model} first");
    if (typeof req.prompt !== "string" && !Array.isArray(req.prompt)) throw new Error("prompt must be a string or an array of token ids");
    const opt = (v: number | null | undefined) => (v === null ? undefined : v); // pages send null for "unset"
    const t0 = performance.now();
    const prompt = req.messages ? engine.applyChatTemplate(checkMessages(req.messages)) : req.prompt;
    const gen = engine.start(prompt, {
      maxTokens: opt(req.maxTokens), temperature: opt(req.temperature), topP: opt(req.topP), topK: opt(req.topK),
      minP: opt(req.minP), repetitionPenalty: opt(req.repetitionPenalty), presencePenalty: opt(req.presencePenalty),
      frequencyPenalty: opt(req.frequencyPenalty), logitBias: req.logitBias ?? null, seed: opt(req.seed),
      chat: !req.messages && !!req.chat,
    });
    const stream = new Utf8Stream();
    let text = "", tFirst = 0, tPrev = t0;
    while (!gen.done) {
      if (cancelled.has(req.id)) { gen.abort(); break; }
      const id = gen.step();
      if (id === null) break;
      const now = performance.now();
      if (gen.tokenIds.length === 1) tFirst = now;
      const delta = engine.isSpecial(id) ? "" : stream.add(tokenBytes(engine.vocab, id));
      text += delta;
      post({ type: "token", id: req.id, tokenId: id, text: delta, ms: now - tPrev });
      tPrev = now;
      await nextTurn(); // let "cancel" in
    }
    const tail = stream.flush();
    text += tail;
    const n = gen.tokenIds.length, end = performance.now();
    post({
      type: "done", id: req.id, tokenIds: gen.tokenIds, text,
      tokensPerSecond: n > 1 ? ((n - 1) * 1000) / (end - tFirst) : 0, finishReason: gen.finishReason,
      ttftMs: n > 0 ? tFirst - t0 : null,
    });
  }

  return (raw: unknown) => {
    const msg = raw as { type?: string; id?: string | number; model?: unknown };
    try {
      if (!msg || typeof msg !== "object") throw new Error("message must be an object with a 'type'");
      switch (msg.type) {
        case "load": {
          if (Array.isArray(msg.model) && msg.model.length > 0 && msg.model.every((p) => p instanceof ArrayBuffer)) {
            msg.model = joinSplit(msg.model); // the parts of a split GGUF, in order (04b)
          }
          const blob = typeof Blob !== "undefined" && msg.model instanceof Blob ? msg.model : null;
          if (!blob && !(msg.model instanceof ArrayBuffer)) throw new Error("load: 'model' must be an ArrayBuffer or a Blob with the GGUF bytes (or an array of the parts of a split GGUF)");
          const t0 = performance.now();
          const maxSeqLen = (msg as { maxSeqLen?: number | null }).maxSeqLen ?? undefined; // optional extension
          const threads = (msg as { threads?: number | null }).threads ?? 1;
          if (!Number.isInteger(threads) || threads < 1) throw new Error(`load: threads must be an integer >= 1, got ${threads}`);
          const onProgress = (stage: string, loaded: number, total: number) => post({ type: "progress", stage, loaded, total });
          const ready = (e: Engine) => {
            const previous = engine;
            engine = e;
            if (previous && previous !== e) previous.close();
            const c = e.config;
            post({
              type: "ready",
              info: {
                engine: "ts-mini", arch: c.arch, layers: c.nLayers, dModel: c.dModel, heads: c.nHeads, kvHeads: c.nKvHeads,
                vocabSize: c.vocabSize, maxSeqLen: e.model.maxSeq, arenaBytes: e.model.arena.byteLength,
                arena: e.model.arena.regions(),
                name: e.gguf.metadata.get("general.name") ?? null, loadMs: performance.now() - t0,
                threads: e.threads, threadNote: e.threadNote,
                crossOriginIsolated: (globalThis as { crossOriginIsolated?: boolean }).crossOriginIsolated ?? null,
              },
            });
          };
          const failed = (err: unknown) => {
            // The previous model (if any) still serves requests; say so, as the Pyodide worker does.
            post({ type: "error", message: message(err), modelKept: engine !== null });
          };
          // an asynchronous load (a Blob's read, a pool's start): requests sent meanwhile wait for it
          const later = (p: Promise<Engine>) => { loading = p.then(ready, failed).finally(() => { loading = null; }); };
          if (blob) {
            later(loadModelFromBlob(blob, { maxSeqLen, onProgress, threads }));
            break;
          }
          const buffer = msg.model as ArrayBuffer;
          if (threads === 1) {
            let e: Engine;
            try {
              e = loadModel(buffer, { maxSeqLen, onProgress });
            } catch (err) {
              failed(err);
              break;
            }
            ready(e);
            break;
          }
          try {
            readConfig(parseGGUF(buffer)); // a file we cannot run is refused now, not after the pool starts
          } catch (err) {
            failed(err);
            break;
          }
          later(loadModelThreaded(buffer, { maxSeqLen, onProgress, threads }));
          break;
        }
        case "generate":
          if (msg.id === undefined) throw new Error("generate: 'id' is required");
          queue.push(msg as GenerateMsg);
          void runQueue();
          break;
        case "cancel": {
          if (msg.id === undefined) throw new Error("cancel: 'id' is required");
          const i = queue.findIndex((q) => q.id === msg.id);
          if (i >= 0) {
            // Not started yet: drop it, reporting it as aborted with nothing generated.
            queue.splice(i, 1);
            post({ type: "done", id: msg.id, tokenIds: [], text: "", tokensPerSecond: 0, finishReason: "abort" });
          } else if (msg.id === current) cancelled.add(msg.id); // seen before its next token
          // any other id: already finished or never sent — nothing to do
          break;
        }
        default:
          throw new Error(`unknown message type ${JSON.stringify(msg.type)} (expected load, generate or cancel)`);
      }
    } catch (e) {
      const err: Record<string, unknown> = { type: "error", message: message(e) };
      if (msg && typeof msg === "object" && msg.id !== undefined) err.id = msg.id;
      if (msg && typeof msg === "object" && msg.type === "load") err.modelKept = engine !== null;
      post(err);
    }
  };
}

// Inside a real worker: wire the handler to the worker's message port.
declare const WorkerGlobalScope: unknown;
if (typeof WorkerGlobalScope !== "undefined" && typeof self !== "undefined") {
  const handle = createHandler((m) => (self as unknown as { postMessage(m: unknown): void }).postMessage(m));
  self.onmessage = (ev: MessageEvent) => handle(ev.data);
}
