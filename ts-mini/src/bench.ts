// npm run bench — load time, prefill speed and decode tok/s at 64 tokens (greedy, EOS ignored so every run
// decodes exactly 64 tokens). Node single thread; the numbers are what a browser worker gets, roughly.

import { loadModel } from "./index.js";
import { defaultModelPath, readArrayBuffer } from "./model_path.js";

const N = 64;
const path = process.argv[2] ?? defaultModelPath();
const t0 = performance.now();
const buf = readArrayBuffer(path);
const t1 = performance.now();
const engine = loadModel(buf);
const t2 = performance.now();
process.stdout.write(`model: ${path}\n`);
process.stdout.write(`read file: ${(t1 - t0).toFixed(0)} ms, parse+tokenizer+arena: ${(t2 - t1).toFixed(0)} ms, ` +
  `arena ${(engine.model.arena.byteLength / 2 ** 20).toFixed(1)} MiB\n`);
const prompt = "The history of computing is a story of abstraction layered upon abstraction.";
engine.generate(prompt, { maxTokens: 4, ignoreEos: true }); // warm up the JIT
for (let run = 0; run < 2; run++) {
  const r = engine.generate(prompt, { maxTokens: N, ignoreEos: true });
  process.stdout.write(`run ${run + 1}: prompt ${r.promptTokens} tok prefill ${r.prefillMs.toFixed(0)} ms ` +
    `(${((r.promptTokens * 1000) / r.prefillMs).toFixed(1)} tok/s) | decode ${r.tokenIds.length} tok: ` +
    `${r.tokensPerSecond.toFixed(2)} tok/s\n`);
}
