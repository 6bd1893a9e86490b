// Step 13c — the hot matvec kernels in WebAssembly SIMD (Python counterpart: none — NumPy's BLAS does this).
//
// The integer kernels of step 06 (dotQ4_1x2i, dotQ8_0x2i) spend most of their time taking bytes apart one
// nibble at a time. WebAssembly's 128-bit SIMD does four int32 multiply-adds per instruction and unpacks 16
// nibbles in two, so the same sums run a few times faster. The module is small and written here as bytes
// (ts-mini stays dependency-free); it computes exactly the JS kernels' integers and their float64 scale
// arithmetic in the same order, so results are bit-identical to step 06 (tests/kernels_simd.test.js).
//
// WebAssembly reads only its own linear memory, so the GGUF is copied into a WebAssembly.Memory (at byte 0:
// tensor offsets stay valid) and the model reads its weights from there; behind the file sit the quantized
// quantized input (xq split in two 16-bit halves, xd, xsum), the f16 table and one output row block. With a pool (13b) the memory is shared and
// every helper thread instantiates the module on it. Where WebAssembly SIMD is missing, nothing changes:
// the JS kernels run.
//
//   per Q4_1 block (20 B: f16 d | f16 m | 16 nibble bytes):  s = Σ q_j·xq_j (int32x4 lanes), acc += d·xd·s + m·xsum
//   per Q8_0 block (34 B: f16 d | 32 int8):                  s = Σ q_j·xq_j,                 acc += d·xd·s

import { GGMLType, TensorInfo } from "./04_tensor_table.js";
import { fillHalfTable } from "./05_f16_bf16.js";

// ---- a few WebAssembly encodings ----
const I32 = 0x7f, F64 = 0x7c, V128 = 0x7b;
const uleb = (n: number): number[] => {
  const out: number[] = [];
  do { let b = n & 0x7f; n >>>= 7; if (n) b |= 0x80; out.push(b); } while (n);
  return out;
};
const sleb = (n: number): number[] => {
  const out: number[] = [];
  for (;;) {
    const b = n & 0x7f; n >>= 7;
    if ((n === 0 && !(b & 0x40)) || (n === -1 && (b & 0x40))) { out.push(b); return out; }
    out.push(b | 0x80);
  }
};
const vec = (items: number[][]): number[] => [...uleb(items.length), ...items.flat()];
const section = (id: number, body: number[]): number[] => [id, ...uleb(body.length), ...body];
const str = (s: string): number[] => vec([...s].map((c) => [c.charCodeAt(0)]));

const get = (i: number) => [0x20, ...uleb(i)], set = (i: number) => [0x21, ...uleb(i)], tee = (i: number) => [0x22, ...uleb(i)];
const i32c = (n: number) => [0x41, ...sleb(n)];
const f64zero = [0x44, 0, 0, 0, 0, 0, 0, 0, 0];
const add = [0x6a], shl = [0x74], ltU = [0x49], geU = [0x4f];
const f64add = [0xa0], f64mul = [0xa2], f64fromI32 = [0xb7], f64fromF32 = [0xbb], f32fromF64 = [0xb6];
const load16u = (o: number) => [0x2f, 0, ...uleb(o)], f32load = [0x2a, 0, 0], f64load = [0x2b, 0, 0], f32store = [0x38, 0, 0];
const f64load8 = [0x2b, 0, 8];
const simd = (op: number, ...imm: number[]) => [0xfd, ...uleb(op), ...imm];
const vload = (o: number) => simd(0x00, 0, ...uleb(o));
const vand = simd(0x4e), i8shrU = simd(0x6d);
const i16lo = (signed: boolean) => simd(signed ? 0x87 : 0x89), i16hi = (signed: boolean) => simd(signed ? 0x88 : 0x8a);
const vadd = simd(0xae), lane = (k: number) => simd(0x1b, k);
const block = (...body: number[][]) => [0x02, 0x40, ...body.flat(), 0x0b];
const loop = (...body: number[][]) => [0x03, 0x40, ...body.flat(), 0x0b];
const brIf = (d: number) => [0x0d, d], br = (d: number) => [0x0c, d];

/** f64 of the f16 at byte w + o, through the table at `half`. */
const halfAt = (half: number, w: number, o: number) => [...get(half), ...get(w), ...load16u(o), ...i32c(2), ...shl, ...add,
  ...f32load, ...f64fromF32];
const vdot = simd(0xba), vshl = simd(0xab);

// The input as the kernels read it, per 32-block b (128 B at xin + 128·b): xq's high parts xh = xq >> 11 (16 x
// i16), then its low parts xl = xq & 2047 (16 x i16), so that Σ q·xq = (Σ q·xh)·2048 + Σ q·xl with 16-bit
// products (i32x4.dot_i16x8_s: eight products, pairwise summed, per instruction) — the same int32 as step 06's
// |q·xq| sums, which stay below 2^31. The scales per block (16 B at sc + 16·b): xd, then xsum.

/**
 * One kernel over R consecutive rows at a time (R = 1 or 2; rows are contiguous, so row j+1 starts where row j
 * ends): for each group, acc_j = Σ_blocks (the block tail of row j), out[r + j] = f32(acc_j). A pair shares the
 * input loads and the loop. `unpack` leaves a block's 32 weights as 4 i16x8 vectors in locals h[0..3] (weights
 * 0-7, 8-15, 16-23, 24-31); `tail` adds the block's scaled sum (int32 in the lanes of its v) to acc.
 * Params: 0 w, 1 nb, 2 rows (a multiple of R), 3 out, 4 xin, 5 sc, 6 half.
 */
function kernel(R: 1 | 2, blockBytes: number, unpack: (w: number, a: number, h: number[]) => number[],
  tail: (w: number, ps: number, half: number, acc: number, s: number[]) => number[]): number[] {
  const nb = 1, rows = 2, out = 3, xin = 4, sc = 5, half = 6, r = 7, xp = 8, ps = 9, wend = 10;
  const W = [0, 11], acc = [12, 13], a = 14, xk = 15, v = [16, 17], h = [[18, 19, 20, 21], [22, 23, 24, 25]];
  const J = R === 1 ? [0] : [0, 1];
  const lanes = (vj: number) => [...get(vj), ...lane(0), ...get(vj), ...lane(1), ...add, ...get(vj), ...lane(2), ...add,
    ...get(vj), ...lane(3), ...add];
  const dots = (o: number, first: boolean) => [0, 1, 2, 3].flatMap((k) => [
    ...get(xp), ...vload(o + 16 * k), ...set(xk),
    ...J.flatMap((j) => [...(first && k === 0 ? [] : get(v[j])), ...get(h[j][k]), ...get(xk), ...vdot,
      ...(first && k === 0 ? [] : vadd), ...set(v[j])]),
  ]);
  const body = [
    ...J.flatMap((j) => unpack(W[j], a, h[j])),
    ...dots(0, true), ...J.flatMap((j) => [...get(v[j]), ...i32c(11), ...vshl, ...set(v[j])]), ...dots(64, false),
    ...J.flatMap((j) => tail(W[j], ps, half, acc[j], lanes(v[j]))),
    ...J.flatMap((j) => [...get(W[j]), ...i32c(blockBytes), ...add, ...set(W[j])]),
    ...get(xp), ...i32c(128), ...add, ...set(xp), ...get(ps), ...i32c(16), ...add, ...set(ps),
  ];
  const code = [
    ...i32c(0), ...set(r),
    ...block(loop(
      get(r), get(rows), geU, brIf(1),
      ...J.map((j) => [...f64zero, ...set(acc[j])]), get(xin), set(xp), get(sc), set(ps),
      get(W[0]), get(nb), i32c(blockBytes), [0x6c], add, tee(wend), R === 2 ? set(W[1]) : [0x1a],
      loop(body, get(W[0]), get(wend), ltU, brIf(0)),
      ...J.map((j) => [...get(out), ...get(r), ...i32c(j), ...add, ...i32c(2), ...shl, ...add, ...get(acc[j]), ...f32fromF64,
        ...f32store]),
      R === 2 ? [...get(W[1]), ...set(W[0])] : [],
      get(r), i32c(R), add, set(r), br(0),
    )),
    0x0b,
  ];
  return [...vec([[...uleb(5), I32], [...uleb(2), F64], [...uleb(12), V128]]), ...code];
}

// Q4_1 (20 B: f16 d, f16 m, 16 bytes: weight j in the low nibble of byte j, weight j+16 in its high nibble):
// acc = acc + (d·xd·s + m·xsum), in the order of dotQ4_1x2i.
const q41Body = (R: 1 | 2) => kernel(R, 20, (w, a, h) => [
  ...get(w), ...vload(4), ...tee(a), ...simd(0x0c, ...new Array(16).fill(0x0f)), ...vand, ...tee(h[0]), ...i16hi(false),
  ...set(h[1]), ...get(h[0]), ...i16lo(false), ...set(h[0]),
  ...get(a), ...i32c(4), ...i8shrU, ...tee(h[2]), ...i16hi(false), ...set(h[3]), ...get(h[2]), ...i16lo(false), ...set(h[2]),
], (w, ps, half, acc, s) => [
  ...get(acc), ...halfAt(half, w, 0), ...get(ps), ...f64load, ...f64mul, ...s, ...f64fromI32, ...f64mul,
  ...halfAt(half, w, 2), ...get(ps), ...f64load8, ...f64mul, ...f64add, ...f64add, ...set(acc),
]);

// Q8_0 (34 B: f16 d, 32 int8): acc = acc + d·xd·s, as dotQ8_0x2i.
const q80Body = (R: 1 | 2) => kernel(R, 34, (w, a, h) => [
  ...get(w), ...vload(2), ...tee(a), ...i16lo(true), ...set(h[0]), ...get(a), ...i16hi(true), ...set(h[1]),
  ...get(w), ...vload(18), ...tee(a), ...i16lo(true), ...set(h[2]), ...get(a), ...i16hi(true), ...set(h[3]),
], (w, ps, half, acc, s) => [
  ...get(acc), ...halfAt(half, w, 0), ...get(ps), ...f64load, ...f64mul, ...s, ...f64fromI32, ...f64mul, ...f64add,
  ...set(acc),
]);

/** The module's bytes: imports env.mem (shared or not), exports q41, q80 (one row per pass) and q41x2, q80x2 (two). */
export function simdModuleBytes(shared: boolean): Uint8Array<ArrayBuffer> {
  const fn = (params: number) => [0x60, ...vec(new Array(params).fill([I32])), 0];
  const mem = shared ? [0x03, ...uleb(1), ...uleb(65536)] : [0x00, ...uleb(1)];
  const code = [q41Body(1), q80Body(1), q41Body(2), q80Body(2)].map((b) => [...uleb(b.length), ...b]);
  return new Uint8Array([
    0x00, 0x61, 0x73, 0x6d, 0x01, 0x00, 0x00, 0x00,
    ...section(1, vec([fn(7)])),
    ...section(2, vec([[...str("env"), ...str("mem"), 0x02, ...mem]])),
    ...section(3, vec([[0], [0], [0], [0]])),
    ...section(7, vec([[...str("q41"), 0x00, 0], [...str("q80"), 0x00, 1], [...str("q41x2"), 0x00, 2], [...str("q80x2"), 0x00, 3]])),
    ...section(10, vec(code)),
  ]);
}

let canSimd: boolean | null = null;
/** Whether this platform runs WebAssembly SIMD (then the Q4_1/Q8_0 matvecs use this step). */
export function simdAvailable(): boolean {
  if (canSimd === null) {
    try {
      canSimd = typeof WebAssembly === "object" && WebAssembly.validate(simdModuleBytes(false));
    } catch {
      canSimd = false;
    }
  }
  return canSimd;
}

/** What a helper thread needs to run the kernels on the same (shared) memory. */
export interface SimdSpec { memory: WebAssembly.Memory; ggufBytes: number; maxIn: number; maxRows: number }

const align = (n: number, a: number) => Math.ceil(n / a) * a;
const isShared = (b: ArrayBufferLike) => typeof SharedArrayBuffer !== "undefined" && b instanceof SharedArrayBuffer;
// Memories made by SimdKernels.reserve, by their buffer; the scratch room behind the file: the input (4.5 bytes
// an input), the f16 table (256 KiB) and one output row block (4 bytes a row) of a 262144-token vocabulary and
// 16384-wide rows fit (~1.4 MiB); a larger model is copied into a memory of its own size.
const reserved = new WeakMap<ArrayBufferLike, WebAssembly.Memory>();
const RESERVE_SCRATCH = 2 << 20;

/** The kernels bound to one memory holding one GGUF at byte 0. */
export class SimdKernels {
  readonly spec: SimdSpec;
  readonly buffer: ArrayBufferLike; // the memory's buffer: the GGUF, then the scratch
  private readonly xin: Int16Array; private readonly sc: Float64Array; private readonly out: Float32Array;
  private readonly q41: (w: number, nb: number, rows: number, out: number, xin: number, sc: number, half: number) => void;
  private readonly q80: SimdKernels["q41"];
  private readonly q41x2: SimdKernels["q41"];
  private readonly q80x2: SimdKernels["q41"];
  private readonly halfPtr: number;

  private constructor(spec: SimdSpec, shared: boolean) {
    this.spec = spec;
    const { memory, ggufBytes, maxIn, maxRows } = spec, nb = Math.ceil(maxIn / 32);
    const L = SimdKernels.layout(ggufBytes, maxIn, maxRows);
    if (memory.buffer.byteLength < L.end) throw new RangeError("SIMD memory is smaller than its layout");
    this.buffer = memory.buffer;
    this.xin = new Int16Array(this.buffer, L.xin, 64 * nb);
    this.sc = new Float64Array(this.buffer, L.sc, 2 * nb);
    this.out = new Float32Array(this.buffer, L.out, maxRows);
    this.halfPtr = L.half;
    const mod = new WebAssembly.Module(simdModuleBytes(shared));
    const ex = new WebAssembly.Instance(mod, { env: { mem: memory } }).exports as Record<string, unknown>;
    this.q41 = ex.q41 as SimdKernels["q41"];
    this.q80 = ex.q80 as SimdKernels["q41"];
    this.q41x2 = ex.q41x2 as SimdKernels["q41"];
    this.q80x2 = ex.q80x2 as SimdKernels["q41"];
  }

  private static layout(ggufBytes: number, maxIn: number, maxRows: number) {
    const nb = Math.ceil(maxIn / 32);
    const xin = align(ggufBytes + 16, 64); // 16 B of slack: a vector load at the file's last block stays inside
    const sc = xin + 128 * nb, half = sc + 16 * nb, out = half + 4 * 65536, end = align(out + 4 * maxRows, 64);
    return { xin, sc, half, out, end };
  }

  /** Bind the kernels to a memory holding the GGUF whose first `ggufBytes` bytes are in `gguf`: the memory
   * `reserve` made, when `gguf` is its buffer and it has room for the scratch; else a new memory (shared for a
   * thread pool) the file is copied into. */
  static create(gguf: ArrayBufferLike, maxIn: number, maxRows: number, shared: boolean,
    ggufBytes = gguf.byteLength): SimdKernels {
    const L = SimdKernels.layout(ggufBytes, maxIn, maxRows), pages = Math.ceil(L.end / 65536);
    let memory = reserved.get(gguf);
    if (!memory || gguf.byteLength < L.end || isShared(gguf) !== shared) {
      memory = new WebAssembly.Memory(shared ? { initial: pages, maximum: pages, shared: true } : { initial: pages });
      new Uint8Array(memory.buffer).set(new Uint8Array(gguf, 0, ggufBytes));
    }
    fillHalfTable(new Float32Array(memory.buffer, L.half, 65536));
    return new SimdKernels({ memory, ggufBytes, maxIn, maxRows }, shared);
  }

  /** A memory to read a GGUF of `ggufBytes` straight into (the file at byte 0, then RESERVE_SCRATCH bytes of
   * room for the scratch), so that `create` takes it without a copy: returns the file's bytes, to be filled. */
  static reserve(ggufBytes: number, shared: boolean): Uint8Array {
    const pages = Math.ceil((ggufBytes + RESERVE_SCRATCH) / 65536);
    const memory = new WebAssembly.Memory(shared ? { initial: pages, maximum: pages, shared: true } : { initial: pages });
    reserved.set(memory.buffer, memory);
    return new Uint8Array(memory.buffer, 0, ggufBytes);
  }

  /** A helper thread's kernels on the memory another thread created (SimdKernels.create(..., shared)). */
  static attach(spec: SimdSpec): SimdKernels {
    return new SimdKernels(spec, true);
  }

  /** Whether the kernels serve tensor t: Q4_1 or Q8_0 weights of the GGUF in this memory. */
  serves(t: TensorInfo): boolean {
    return (t.type === GGMLType.Q4_1 || t.type === GGMLType.Q8_0) && t.offset + t.nbytes <= this.spec.ggufBytes
      && t.rowLength <= this.spec.maxIn && t.rows <= this.spec.maxRows;
  }

  /** Put the quantized input (prepareInputInt's xq, xd, xsum for n inputs, n a multiple of 32) where the kernels read it. */
  setInput(xq: Int32Array, xd: Float64Array, xsum: Float64Array, n: number): void {
    const xin = this.xin, sc = this.sc;
    for (let b = 0, i = 0; i < n; b++) {
      const o = 64 * b;
      for (let j = 0; j < 32; j++, i++) {
        const q = xq[i];
        xin[o + j] = q >> 11;
        xin[o + 32 + j] = q & 2047;
      }
      sc[2 * b] = xd[b];
      sc[2 * b + 1] = xsum[b];
    }
  }

  /** out[oo + r] = W[r,:] · input for rows r0 .. r1 of t (input set by setInput). */
  rows(t: TensorInfo, out: Float32Array, oo: number, r0: number, r1: number): void {
    if (r1 <= r0) return;
    const q4 = t.type === GGMLType.Q4_1, n = r1 - r0, pairs = n & ~1, nb = t.rowLength / 32;
    const w = t.offset + r0 * t.rowBytes, o = this.out.byteOffset + 4 * r0, xin = this.xin.byteOffset, sc = this.sc.byteOffset;
    if (pairs) (q4 ? this.q41x2 : this.q80x2)(w, nb, pairs, o, xin, sc, this.halfPtr); // two rows per pass
    if (n > pairs) (q4 ? this.q41 : this.q80)(w + pairs * t.rowBytes, nb, 1, o + 4 * pairs, xin, sc, this.halfPtr);
    out.set(this.out.subarray(r0, r1), oo + r0);
  }
}
