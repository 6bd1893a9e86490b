// A helper thread of the matmul pool (13b_matmul_pool.ts): one init message with the shared buffers, a reply,
// then it serves row ranges until the pool stops. Runs as a Web Worker (module) or a Node worker_threads Worker.

import { RowWorker, jobCounter, serveJobs } from "./13b_matmul_pool.js";
import type { SimdSpec } from "./13c_simd.js";

interface Init { gguf: SharedArrayBuffer; arena: SharedArrayBuffer; ctl: SharedArrayBuffer; prm: SharedArrayBuffer; k: number; maxIn: number; simd: SimdSpec | null }

function start(init: Init, reply: (m: unknown) => void): void {
  const worker = new RowWorker(init.gguf, init.arena, init.maxIn, init.simd);
  const ctl = new Int32Array(init.ctl), prm = new Float64Array(init.prm);
  const seen = jobCounter(ctl); // before the reply: the pool may post a job as soon as it hears from us
  reply({ ready: init.k });
  serveJobs(ctl, prm, worker, init.k, seen); // blocks this thread until the pool stops
}

declare const WorkerGlobalScope: unknown;
if (typeof WorkerGlobalScope !== "undefined" && typeof self !== "undefined") {
  self.onmessage = (ev: MessageEvent) => {
    // reply first, then block: postMessage is delivered even though this thread never returns to its loop
    start(ev.data as Init, (m) => (self as unknown as { postMessage(m: unknown): void }).postMessage(m));
  };
} else {
  const { parentPort } = await import("node:worker_threads");
  parentPort!.once("message", (init: Init) => start(init, (m) => parentPort!.postMessage(m)));
}
