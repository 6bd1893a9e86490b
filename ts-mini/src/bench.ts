// npm run bench — each matvec kernel on the model's own tensors (the float64 kernels against the integer ones,
// CPU ms per call: the kernels are measured one by one), then load time, prefill speed and decode tok/s at 64
// tokens (greedy, EOS ignored so every run decodes exactly 64 tokens), on one thread and on N (--threads N, default: all cores, at least 2), alternating. Besides wall-clock speed
// it prints speed per CPU-second of this process: on a shared, busy machine that is roughly what one idle
// core would give (wall time includes waiting).

import { availableParallelism } from "node:os";
import { loadModel, loadModelThreaded } from "./index.js";
import { parseGGUF } from "./04_tensor_table.js";
import { fillHalfTable, makeWeightViews } from "./05_f16_bf16.js";
import { MatScratch, matvec, useLut } from "./13_matmul.js";
import { SimdKernels, simdAvailable } from "./13c_simd.js";
import { defaultModelPath, readArrayBuffer } from "./model_path.js";

const N = 64;
const args = process.argv.slice(2); // [MODEL.gguf] [--threads N]
const path = args.find((a, i) => !a.startsWith("--") && args[i - 1] !== "--threads") ?? defaultModelPath();
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

// ---- kernels, one by one ----
{
  const g = parseGGUF(buf);
  const w = makeWeightViews(buf, fillHalfTable(new Float32Array(65536)));
  const names = ["blk.0.ffn_gate.weight", "blk.0.ffn_down.weight", "blk.0.attn_k.weight", "output.weight", "token_embd.weight"];
  const seen = new Set<string>();
  const sk = simdAvailable() ? SimdKernels.create(buf, 1536, 65536, false) : null; // the GGUF in SIMD memory
  const ws = sk ? makeWeightViews(sk.buffer, w.half) : w;
  for (const name of names) {
    const t = g.tensors.get(name);
    if (!t || (name === "token_embd.weight" && g.tensors.has("output.weight"))) continue;
    const label = `${name} ${t.rows}x${t.rowLength} type ${t.type}`;
    if (seen.has(label)) continue;
    seen.add(label);
    const n = t.rowLength, x = new Float32Array(n);
    for (let i = 0; i < n; i++) x[i] = Math.sin(i * 0.37) * 0.5;
    const out = new Float32Array(t.rows);
    const f64: MatScratch = { xs: new Float64Array(n), xsum: new Float64Array(n / 32), row: new Float32Array(2 * n) };
    const int: MatScratch = { ...f64, xq: new Int32Array(n), xd: new Float64Array(n / 32) };
    const lut: MatScratch = { ...int, lut: new Int32Array((n / 32) * 4096) };
    const withLut = useLut(t, lut), simd: MatScratch = { ...int, simd: sk };
    const withSimd = sk !== null && sk.serves(t);
    const reps = Math.max(3, Math.round(2e7 / (t.rows * n)));
    const time = (sc: MatScratch) => {
      const c = process.cpuUsage(), views = sc.simd ? ws : w;
      for (let k = 0; k < reps; k++) matvec(views, t, x, 0, out, 0, sc);
      return cpuMs(process.cpuUsage(c)) / reps;
    };
    time(f64); time(int); if (withLut) time(lut); if (withSimd) time(simd); // warm up
    let a = Infinity, b = Infinity, c = Infinity, d = Infinity;
    for (let k = 0; k < 3; k++) { // alternate, best of 3
      a = Math.min(a, time(f64)); b = Math.min(b, time(int)); if (withLut) c = Math.min(c, time(lut));
      if (withSimd) d = Math.min(d, time(simd));
    }
    process.stdout.write(`kernel ${label}: float64 ${a.toFixed(3)} ms, integer ${b.toFixed(3)} ms` +
      (withLut ? `, integer+table ${c.toFixed(3)} ms` : "") + (withSimd ? `, wasm simd ${d.toFixed(3)} ms` : "") +
      ` per matvec (cpu) -> ${(a / Math.min(b, c, d)).toFixed(2)}x\n`);
  }
}

const ids = engine.encode("The history of computing is a story of abstraction layered upon abstraction.");
const threadsArg = process.argv.indexOf("--threads");
const nThreads = threadsArg > 0 ? Number(process.argv[threadsArg + 1]) : Math.max(2, availableParallelism());
const pooled = await loadModelThreaded(buf, { threads: nThreads });
if (pooled.threadNote) process.stdout.write(`note: ${pooled.threadNote}\n`);
const noSimd = loadModel(buf, { simd: false }); // the JS integer kernels, for comparison
const engines = [{ label: "1 thread, no SIMD", e: noSimd }, { label: `1 thread${engine.model.simd ? ", SIMD" : ""}`, e: engine },
  { label: `${pooled.threads} threads`, e: pooled }];
for (const { e } of engines) e.generate(ids, { maxTokens: 4, ignoreEos: true }); // warm up the JIT

for (let run = 1; run <= 2; run++) {
  for (const { label, e } of engines) { // alternating, so both see the same load on a shared host
    const gen = e.start(ids, { maxTokens: N, ignoreEos: true, temperature: 0 });
    let c = process.cpuUsage(), w = performance.now();
    gen.step(); // prefill + first token
    const preWall = performance.now() - w, preCpu = cpuMs(process.cpuUsage(c));
    c = process.cpuUsage(); w = performance.now();
    while (gen.step() !== null);
    const decWall = performance.now() - w, decCpu = cpuMs(process.cpuUsage(c)), n = gen.tokenIds.length - 1;
    process.stdout.write(`run ${run} ${label}: prefill ${ids.length} tok ${preWall.toFixed(0)} ms (${rate(ids.length, preWall)} tok/s wall, ` +
      `${rate(ids.length, preCpu)} tok/s cpu) | decode ${n + 1} tok: ${rate(n, decWall)} tok/s wall, ${rate(n, decCpu)} tok/s cpu\n`);
  }
}
pooled.close();
