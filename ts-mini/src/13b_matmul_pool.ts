// Step 13b — the matmul step on all cores: a pool of worker threads that split each product by rows
// (Python counterpart: none — pyengine parallelises across processes, S13/S17; NumPy's BLAS threads inside).
//
// The weights (the GGUF buffer) and the arena are SharedArrayBuffers, so every thread reads the same weights
// and activations and writes its own rows of the same output: nothing is copied per product. One product:
//   main: writes the job (tensor, where x / the prepared input / the output live in the arena) into `prm`,
//         sets `pending` = helpers, bumps `seq` and wakes the helpers (Atomics.notify);
//         computes its own row range; waits (Atomics.wait) until `pending` is 0.
//   helper k: wakes on `seq`, computes rows [bounds[k], bounds[k+1]), decrements `pending` (last one notifies).
// Row ranges are even-aligned so the two-row kernels keep their pairs; results are bit-identical to one thread
// (each row is computed by the same kernel, only by another thread). The input of a matvec is prepared
// (quantized) once, by the main thread, into the shared scratch before the job is posted.
// Needs cross-origin isolation in a browser (COOP/COEP, see pyengine web / the static build's shim) and
// blocking waits, so the engine must itself run in a worker (it does: worker.ts); in Node, worker_threads.

import type { TensorInfo } from "./04_tensor_table.js";
import { WeightViews, fillHalfTable, makeWeightViews } from "./05_f16_bf16.js";
import { MatScratch, RowSplitter, matmulRows, matvecRows } from "./13_matmul.js";
import { SimdKernels, SimdSpec } from "./13c_simd.js";

// control words (Int32Array) and job parameters (Float64Array)
const SEQ = 0, PENDING = 1, STOP = 2, FAILED = 3;
const P = {
  kind: 0, type: 1, offset: 2, rows: 3, rowBytes: 4, rowLength: 5, out: 6, T: 7, x: 8, xs: 9, xsum: 10, xq: 11, xd: 12,
  nIn: 13, parts: 14, lut: 15, lutLen: 16,
} as const;
const SPIN = 400; // polls before sleeping in Atomics.wait: short, the host may be shared

/** Whether this platform can share memory between threads (browser: only when cross-origin isolated). */
export function canShareMemory(): boolean {
  if (typeof SharedArrayBuffer === "undefined" || typeof Atomics === "undefined") return false;
  const iso = (globalThis as { crossOriginIsolated?: boolean }).crossOriginIsolated;
  return iso === undefined || iso; // Node has no such flag and always can
}

/** A SharedArrayBuffer copy of `b` (or `b` itself if already shared). */
export function toShared(b: ArrayBufferLike): SharedArrayBuffer {
  if (b instanceof SharedArrayBuffer) return b;
  const s = new SharedArrayBuffer(b.byteLength);
  new Uint8Array(s).set(new Uint8Array(b));
  return s;
}

/** Start row of part k of n over `rows` rows (even, so row pairs stay together). */
export function partStart(rows: number, k: number, n: number): number {
  return k >= n ? rows : Math.min(rows, Math.floor((rows * k) / n / 2) * 2);
}

interface Job { t: TensorInfo; out: Float32Array; oo: number; x: Float32Array | null; s: MatScratch | null; T: number }

/** What a helper thread runs per job (shared by matmul_worker.ts and the tests). */
/** The job counter, to pass to serveJobs (read it before replying "ready"). */
export function jobCounter(ctl: Int32Array): number {
  return Atomics.load(ctl, SEQ);
}

export class RowWorker {
  private readonly w: WeightViews;
  private readonly f32: Float32Array; private readonly f64: Float64Array; private readonly i32: Int32Array;
  private readonly row: Float32Array;
  private readonly tensors = new Map<number, TensorInfo>();
  private readonly xViews = new Map<number, Float32Array>();
  private scratch: MatScratch | null = null;
  private readonly simd: SimdKernels | null;

  /** simd: the main thread's SIMD memory (then `gguf` is its buffer), or none. */
  constructor(gguf: ArrayBufferLike, arena: ArrayBufferLike, maxIn: number, simd?: SimdSpec | null) {
    this.simd = simd ? SimdKernels.attach(simd) : null;
    this.w = makeWeightViews(gguf, fillHalfTable(new Float32Array(65536)));
    this.f32 = new Float32Array(arena); this.f64 = new Float64Array(arena, 0, arena.byteLength >>> 3);
    this.i32 = new Int32Array(arena);
    this.row = new Float32Array(2 * maxIn);
  }

  run(prm: Float64Array, k: number): void {
    const off = prm[P.offset];
    let t = this.tensors.get(off);
    if (!t) {
      t = { name: `@${off}`, shape: [], type: prm[P.type], offset: off, nbytes: prm[P.rows] * prm[P.rowBytes],
        rowLength: prm[P.rowLength], rows: prm[P.rows], rowBytes: prm[P.rowBytes] };
      this.tensors.set(off, t);
    }
    const n = prm[P.parts], r0 = partStart(t.rows, k, n), r1 = partStart(t.rows, k + 1, n);
    if (r0 >= r1) return;
    if (prm[P.kind] === 0) {
      let s = this.scratch;
      if (!s || s.xs.byteOffset !== prm[P.xs]) {
        const nIn = prm[P.nIn], nb = Math.ceil(nIn / 32);
        s = this.scratch = {
          xs: this.f64.subarray(prm[P.xs] / 8, prm[P.xs] / 8 + nIn), xsum: this.f64.subarray(prm[P.xsum] / 8, prm[P.xsum] / 8 + nb),
          row: this.row,
          xq: prm[P.xq] >= 0 ? this.i32.subarray(prm[P.xq] / 4, prm[P.xq] / 4 + nIn) : undefined,
          xd: prm[P.xd] >= 0 ? this.f64.subarray(prm[P.xd] / 8, prm[P.xd] / 8 + nb) : undefined,
          lut: prm[P.lut] >= 0 ? this.i32.subarray(prm[P.lut] / 4, prm[P.lut] / 4 + prm[P.lutLen]) : undefined,
          simd: this.simd,
        };
      }
      matvecRows(this.w, t, this.f32, prm[P.out] / 4, s, r0, r1);
    } else {
      const xo = prm[P.x], T = prm[P.T];
      let x = this.xViews.get(xo);
      if (!x) { x = this.f32.subarray(xo / 4); this.xViews.set(xo, x); }
      const out = this.f32.subarray(prm[P.out] / 4);
      matmulRows(this.w, t, x, T, out, this.row, r0, r1);
    }
  }
}

/**
 * The helper loop: wait for a job, run it, report; until STOP. `seen` is the job counter read BEFORE the
 * helper told the pool it is ready (else a job posted in between would be missed and the pool would hang).
 */
export function serveJobs(ctl: Int32Array, prm: Float64Array, worker: RowWorker, k: number, seen: number): void {
  for (;;) {
    let spins = 0;
    while (Atomics.load(ctl, SEQ) === seen) {
      if (++spins > SPIN) { Atomics.wait(ctl, SEQ, seen); spins = 0; }
    }
    seen = Atomics.load(ctl, SEQ);
    if (Atomics.load(ctl, STOP)) return;
    try {
      worker.run(prm, k);
    } catch {
      Atomics.store(ctl, FAILED, 1);
    } finally {
      if (Atomics.sub(ctl, PENDING, 1) === 1) Atomics.notify(ctl, PENDING);
    }
  }
}

interface ThreadHandle { postMessage(m: unknown): void; terminate(): unknown }

/** Start one helper thread running matmul_worker.js; resolves once it is waiting for jobs. */
async function spawn(init: Record<string, unknown>): Promise<ThreadHandle> {
  const url = new URL("./matmul_worker.js", import.meta.url);
  const isNode = typeof process !== "undefined" && !!(process as { versions?: { node?: string } }).versions?.node;
  if (isNode) {
    const wt = await import("node:worker_threads");
    const w = new wt.Worker(url);
    w.unref(); // a helper never keeps the process alive
    await new Promise<void>((resolve, reject) => {
      w.once("message", () => resolve());
      w.once("error", reject);
      w.postMessage(init);
    });
    return w;
  }
  const w = new Worker(url, { type: "module" });
  await new Promise<void>((resolve, reject) => {
    w.onmessage = () => resolve();
    w.onerror = (e) => reject(new Error(`matmul worker failed to start: ${e.message ?? e}`));
    w.postMessage(init);
  });
  return w;
}

/** N threads (this one + N-1 helpers) splitting every product of a model whose weights and arena are shared. */
export class MatmulPool implements RowSplitter {
  readonly threads: number;
  private readonly ctl: Int32Array;
  private readonly prm: Float64Array;
  private readonly arena: ArrayBufferLike;
  private readonly helpers: ThreadHandle[];
  private readonly w: WeightViews;
  private readonly rowScratch: Float32Array;
  private closed = false;

  private constructor(threads: number, ctl: Int32Array, prm: Float64Array, arena: ArrayBufferLike, helpers: ThreadHandle[],
    w: WeightViews, maxIn: number) {
    this.threads = threads; this.ctl = ctl; this.prm = prm; this.arena = arena; this.helpers = helpers; this.w = w;
    this.rowScratch = new Float32Array(2 * maxIn);
  }

  /**
   * threads >= 2; gguf and arena must be SharedArrayBuffers; w: the model's weight views; maxIn: longest row;
   * simd: the model's SIMD kernels' spec (13c) when it has them (then gguf is their memory's buffer).
   */
  static async start(threads: number, gguf: SharedArrayBuffer, arena: SharedArrayBuffer, w: WeightViews,
    maxIn: number, simd: SimdSpec | null = null): Promise<MatmulPool> {
    if (!Number.isInteger(threads) || threads < 2) throw new RangeError(`a pool needs >= 2 threads, got ${threads}`);
    if (!(gguf instanceof SharedArrayBuffer) || !(arena instanceof SharedArrayBuffer)) {
      throw new TypeError("MatmulPool needs the weights and the arena in SharedArrayBuffers");
    }
    const ctl = new Int32Array(new SharedArrayBuffer(64));
    const prm = new Float64Array(new SharedArrayBuffer(8 * 32));
    const helpers: ThreadHandle[] = [];
    try {
      for (let k = 0; k < threads - 1; k++) helpers.push(await spawn({ gguf, arena, ctl: ctl.buffer, prm: prm.buffer, k, maxIn, simd }));
    } catch (e) {
      Atomics.store(ctl, STOP, 1); Atomics.add(ctl, SEQ, 1); Atomics.notify(ctl, SEQ);
      for (const h of helpers) void h.terminate();
      throw e;
    }
    return new MatmulPool(threads, ctl, prm, arena, helpers, w, maxIn);
  }

  private inArena(a: { buffer: ArrayBufferLike } | undefined): boolean {
    return a !== undefined && a.buffer === this.arena;
  }

  private post(t: TensorInfo, kind: number): void {
    const p = this.prm;
    p[P.kind] = kind; p[P.type] = t.type; p[P.offset] = t.offset; p[P.rows] = t.rows; p[P.rowBytes] = t.rowBytes;
    p[P.rowLength] = t.rowLength; p[P.parts] = this.threads;
  }

  private runAll(job: Job): void {
    const ctl = this.ctl, helpers = this.threads - 1;
    Atomics.store(ctl, PENDING, helpers);
    Atomics.add(ctl, SEQ, 1);
    Atomics.notify(ctl, SEQ);
    // this thread takes the last part
    const { t } = job, r0 = partStart(t.rows, helpers, this.threads);
    if (job.x === null) matvecRows(this.w, t, job.out, job.oo, job.s!, r0, t.rows);
    else matmulRows(this.w, t, job.x, job.T, job.out, this.rowScratch, r0, t.rows);
    let spins = 0;
    for (;;) {
      const left = Atomics.load(ctl, PENDING);
      if (left === 0) break;
      if (++spins > SPIN) { Atomics.wait(ctl, PENDING, left); spins = 0; }
    }
    if (Atomics.load(ctl, FAILED)) {
      Atomics.store(ctl, FAILED, 0);
      throw new Error(`a matmul worker failed on tensor "${t.name}"`);
    }
  }

  matvec(t: TensorInfo, out: Float32Array, oo: number, s: MatScratch): boolean {
    if (this.closed || !this.inArena(out) || !this.inArena(s.xs) || !this.inArena(s.xsum)) return false;
    const useInt = s.xq !== undefined && s.xd !== undefined;
    if (useInt && (!this.inArena(s.xq) || !this.inArena(s.xd))) return false;
    const lut = useInt && s.lut !== undefined && this.inArena(s.lut);
    if (useInt && s.lut !== undefined && !lut) return false;
    this.post(t, 0);
    const p = this.prm;
    p[P.out] = out.byteOffset + 4 * oo; p[P.xs] = s.xs.byteOffset; p[P.xsum] = s.xsum.byteOffset;
    p[P.xq] = useInt ? s.xq!.byteOffset : -1; p[P.xd] = useInt ? s.xd!.byteOffset : -1; p[P.nIn] = s.xs.length;
    p[P.lut] = lut ? s.lut!.byteOffset : -1; p[P.lutLen] = lut ? s.lut!.length : 0;
    this.runAll({ t, out, oo, x: null, s, T: 1 });
    return true;
  }

  matmul(t: TensorInfo, x: Float32Array, T: number, out: Float32Array): boolean {
    if (this.closed || !this.inArena(x) || !this.inArena(out)) return false;
    this.post(t, 1);
    const p = this.prm;
    p[P.x] = x.byteOffset; p[P.out] = out.byteOffset; p[P.T] = T;
    this.runAll({ t, out, oo: 0, x, s: null, T });
    return true;
  }

  /** Stop and release the helper threads (the model then runs on one thread). */
  close(): void {
    if (this.closed) return;
    this.closed = true;
    Atomics.store(this.ctl, STOP, 1);
    Atomics.add(this.ctl, SEQ, 1);
    Atomics.notify(this.ctl, SEQ);
    for (const h of this.helpers) void h.terminate();
  }
}
