// npm run bench — load time, prefill speed and decode tok/s at 64 tokens (greedy, EOS ignored so every run
// decodes exactly 64 tokens), single thread. Besides wall-clock speed it prints speed per CPU-second of this
// process: on a shared, busy machine that is roughly what one idle core would give (wall time includes waiting).

import { loadModel } from "./index.js";
import { defaultModelPath, readArrayBuffer } from "./model_path.js";

const N = 64;
const path = process.argv[2] ?? defaultModelPath();
const cpuMs = (c: { user: number; system: number }) => (c.user + c.system) / 1000;
const rate = (n: number, ms: number) => ((n * 1000) / ms).toFixed(2);

const t0 = performance.now();
const buf = readArrayBuffer(path);
const t1 = performance.now();
const engine = loadModel(buf);
const t2 = performance.now();
process.stdout.write(`model: ${path}\n`);
process.stdout.write(`load: read file ${(t1 - t0).toFixed(0)} ms, parse+tokenizer+arena ${(t2 - t1).toFixed(0)} ms ` +
  `(arena ${(engine.model.arena.byteLength / 2 ** 20).toFixed(1)} MiB; weights stay in the file buffer)\n`);
const ids = engine.encode("The history of computing is a story of abstraction layered upon abstraction.");
engine.generate(ids, { maxTokens: 4, ignoreEos: true }); // warm up the JIT

for (let run = 1; run <= 2; run++) {
  const gen = engine.start(ids, { maxTokens: N, ignoreEos: true, temperature: 0 });
  let c = process.cpuUsage(), w = performance.now();
  gen.step(); // prefill + first token
  const preWall = performance.now() - w, preCpu = cpuMs(process.cpuUsage(c));
  c = process.cpuUsage(); w = performance.now();
  while (gen.step() !== null);
  const decWall = performance.now() - w, decCpu = cpuMs(process.cpuUsage(c)), n = gen.tokenIds.length - 1;
  process.stdout.write(`run ${run}: prefill ${ids.length} tok ${preWall.toFixed(0)} ms (${rate(ids.length, preWall)} tok/s wall, ` +
    `${rate(ids.length, preCpu)} tok/s cpu) | decode ${n + 1} tok: ${rate(n, decWall)} tok/s wall, ${rate(n, decCpu)} tok/s cpu\n`);
}
