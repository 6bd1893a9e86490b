// Step 13 — matrix-vector and matrix-matrix products over quantized weights (Python: pyengine/models/llama.py
// linear layers, via pyengine/gguf/quants.py dequantize).
//
// matvec (decode, one token): out[r] = Σ_i W[r,i]·x[i] with the fused dequant-dot kernels — the weights are
// read once per token straight from the GGUF buffer (the hot types two rows per call, sharing the x loads).
// matmul (prefill, T tokens): weight rows are dequantized once, two at a time, into scratch and dotted with all
// T inputs in 2x4 tiles, so the unpacking cost is shared by the whole chunk — except where the SIMD kernels
// (13c) serve the tensor: there T matvecs are 3.6x faster than the tiles (13-token prefill 876 -> 244 ms).
// The hot types (Q4_1, Q8_0) use the integer kernels when the scratch has room for integer activations (xq, xd).
// Both products are written as "rows r0..r1 of the output", so a worker pool (13b_matmul_pool.ts, attached as
// scratch.pool) can split them by rows over threads sharing the weights and the arena: that is the only place
// where threads appear; the model (step 18) calls matmul() as before.

import { GGUFError } from "./02_gguf_header.js";
import { GGMLType, TensorInfo, typeName } from "./04_tensor_table.js";
import { WeightViews, dequantBF16, dequantF16, dequantF32, dotBF16, dotF16, dotF32 } from "./05_f16_bf16.js";
import {
  LUT_MAX_IN, LUT_MIN_ROWS, QMAX_Q4, QMAX_Q8, buildQ4Lut, dotQ4_1lut, dequantQ4_0, dequantQ4_1, dequantQ5_0, dequantQ8_0, dotQ4_0, dotQ4_1, dotQ4_1i, dotQ4_1x2,
  dotQ4_1x2i, dotQ5_0, dotQ8_0, dotQ8_0i, dotQ8_0x2, dotQ8_0x2i, prepareInput, prepareInputInt,
} from "./06_q8_q4_dot.js";
import { dequantQ4_K, dequantQ6_K, dotQ4_K, dotQ6_K } from "./07_kquants.js";
import type { SimdKernels } from "./13c_simd.js";

type Dequant = (w: WeightViews, off: number, n: number, out: Float32Array, o: number) => void;
const DEQUANT: Record<number, Dequant> = {
  [GGMLType.F32]: dequantF32, [GGMLType.F16]: dequantF16, [GGMLType.BF16]: dequantBF16,
  [GGMLType.Q8_0]: dequantQ8_0, [GGMLType.Q4_0]: dequantQ4_0, [GGMLType.Q4_1]: dequantQ4_1,
  [GGMLType.Q5_0]: dequantQ5_0, [GGMLType.Q4_K]: dequantQ4_K, [GGMLType.Q6_K]: dequantQ6_K,
};

export function isSupported(type: number): boolean {
  return type in DEQUANT;
}

export function checkSupported(t: TensorInfo): void {
  if (!isSupported(t.type)) throw new GGUFError(`tensor "${t.name}" has ggml type ${typeName(t.type)}, which ts-mini cannot compute with`);
}

/** Row r of tensor t, dequantized to float32 into out[o .. o + rowLength). */
export function dequantRow(w: WeightViews, t: TensorInfo, r: number, out: Float32Array, o: number): void {
  if (!Number.isInteger(r) || r < 0 || r >= t.rows) throw new RangeError(`row ${r} out of range for tensor "${t.name}" (${t.rows} rows)`);
  const f = DEQUANT[t.type];
  if (!f) checkSupported(t);
  f(w, t.offset + r * t.rowBytes, t.rowLength, out, o);
}

/** Splits a product by rows over threads (13b_matmul_pool.ts); false = it did not take the call. */
export interface RowSplitter {
  matvec(t: TensorInfo, out: Float32Array, oo: number, s: MatScratch): boolean;
  matmul(t: TensorInfo, x: Float32Array, T: number, out: Float32Array): boolean;
}

/** Scratch a matvec/matmul needs: f64 copy of the input and its 32-element block sums. */
export interface MatScratch {
  xs: Float64Array; // >= max input length
  xsum: Float64Array; // >= max input length / 32
  row: Float32Array; // >= 2 * max input length (prefill: two dequantized weight rows)
  xq?: Int32Array; // >= max input length: integer activations (Q4_1/Q8_0 kernels); without it, the f64 kernels
  xd?: Float64Array; // >= max input length / 32: their per-block scales
  lut?: Int32Array; // >= LUT_MAX_IN / 32 * 4096: Q4_1 lookup table of the input (tall matrices), optional
  pool?: RowSplitter | null; // split products over threads
  simd?: SimdKernels | null; // WebAssembly SIMD kernels (13c_simd.ts) over the memory holding the weights
}

/** Whether the integer kernels serve tensor type `type` with this scratch. */
function intKernel(type: number, s: MatScratch): boolean {
  return s.xq !== undefined && s.xd !== undefined && (type === GGMLType.Q4_1 || type === GGMLType.Q8_0);
}

/** Whether the Q4_1 lookup-table kernel serves tensor t (tall, short rows, a table in the scratch). */
export function useLut(t: TensorInfo, s: MatScratch): boolean {
  return t.type === GGMLType.Q4_1 && s.lut !== undefined && s.xq !== undefined && t.rows >= LUT_MIN_ROWS
    && t.rowLength <= LUT_MAX_IN && s.lut.length >= (t.rowLength / 32) * 4096;
}

/** Quantize/copy the input x[xo .. xo+n) into the scratch for the matvec kernels of tensor t. */
export function prepareMatvec(t: TensorInfo, x: Float32Array, xo: number, s: MatScratch): void {
  if (intKernel(t.type, s)) {
    prepareInputInt(x, xo, t.rowLength, t.type === GGMLType.Q4_1 ? QMAX_Q4 : QMAX_Q8, s.xq!, s.xd!, s.xsum);
    if (s.simd && s.simd.serves(t)) s.simd.setInput(s.xq!, s.xd!, s.xsum, t.rowLength);
    else if (useLut(t, s)) buildQ4Lut(s.xq!, t.rowLength, s.lut!);
  }
  else prepareInput(x, xo, t.rowLength, s.xs, s.xsum);
}

/** out[oo + r] = W[r,:] · x[xo .. xo + n) for every row r of W. */
export function matvec(w: WeightViews, t: TensorInfo, x: Float32Array, xo: number, out: Float32Array, oo: number,
  s: MatScratch): void {
  prepareMatvec(t, x, xo, s);
  if (s.pool && s.pool.matvec(t, out, oo, s)) return;
  matvecRows(w, t, out, oo, s, 0, t.rows);
}

/** Rows r0 .. r1 of a matvec whose input prepareMatvec has put in s (r0 even, so row pairs stay pairs). */
export function matvecRows(w: WeightViews, t: TensorInfo, out: Float32Array, oo: number, s: MatScratch, r0: number,
  r1: number): void {
  const n = t.rowLength, rows = r1, rb = t.rowBytes;
  const xs = s.xs, xsum = s.xsum;
  let off = t.offset + r0 * rb;
  if (intKernel(t.type, s)) {
    if (s.simd && s.simd.serves(t)) return s.simd.rows(t, out, oo, r0, r1); // the same sums, in WebAssembly SIMD
    const xq = s.xq!, xd = s.xd!;
    let r = r0;
    if (useLut(t, s)) {
      const lut = s.lut!;
      for (; r < rows; r++, off += rb) out[oo + r] = dotQ4_1lut(w, off, lut, xd, xsum, n);
    } else if (t.type === GGMLType.Q4_1) {
      for (; r + 2 <= rows; r += 2, off += 2 * rb) dotQ4_1x2i(w, off, rb, xq, xd, xsum, n, out, oo + r);
      if (r < rows) out[oo + r] = dotQ4_1i(w, off, xq, xd, xsum, n);
    } else {
      for (; r + 2 <= rows; r += 2, off += 2 * rb) dotQ8_0x2i(w, off, rb, xq, xd, n, out, oo + r);
      if (r < rows) out[oo + r] = dotQ8_0i(w, off, xq, xd, n);
    }
    return;
  }
  switch (t.type) {
    case GGMLType.Q4_1: {
      let r = r0;
      for (; r + 2 <= rows; r += 2, off += 2 * rb) dotQ4_1x2(w, off, rb, xs, xsum, n, out, oo + r);
      if (r < rows) out[oo + r] = dotQ4_1(w, off, xs, xsum, n);
      break;
    }
    case GGMLType.Q8_0: {
      let r = r0;
      for (; r + 2 <= rows; r += 2, off += 2 * rb) dotQ8_0x2(w, off, rb, xs, n, out, oo + r);
      if (r < rows) out[oo + r] = dotQ8_0(w, off, xs, n);
      break;
    }
    case GGMLType.Q4_0: for (let r = r0; r < rows; r++, off += rb) out[oo + r] = dotQ4_0(w, off, xs, xsum, n); break;
    case GGMLType.Q5_0: for (let r = r0; r < rows; r++, off += rb) out[oo + r] = dotQ5_0(w, off, xs, xsum, n); break;
    case GGMLType.Q4_K: for (let r = r0; r < rows; r++, off += rb) out[oo + r] = dotQ4_K(w, off, xs, xsum, n); break;
    case GGMLType.Q6_K: for (let r = r0; r < rows; r++, off += rb) out[oo + r] = dotQ6_K(w, off, xs, n); break;
    case GGMLType.F32: for (let r = r0; r < rows; r++, off += rb) out[oo + r] = dotF32(w, off, xs, n); break;
    case GGMLType.F16: for (let r = r0; r < rows; r++, off += rb) out[oo + r] = dotF16(w, off, xs, n); break;
    case GGMLType.BF16: for (let r = r0; r < rows; r++, off += rb) out[oo + r] = dotBF16(w, off, xs, n); break;
    default: checkSupported(t);
  }
}

/**
 * T tokens at once: x is [T, n] (row stride n), out is [T, rows] (row stride rows).
 * Weight rows are dequantized once, two at a time, and each pair is dotted with the tokens four at a time:
 * a 2x4 tile of accumulators, so every value loaded feeds two or four products.
 */
export function matmul(w: WeightViews, t: TensorInfo, x: Float32Array, T: number, out: Float32Array,
  s: MatScratch): void {
  if (T === 1) return matvec(w, t, x, 0, out, 0, s);
  if (s.simd && intKernel(t.type, s) && s.simd.serves(t)) { // SIMD matvecs, token by token, beat the f32 tiles
    for (let k = 0; k < T; k++) matvec(w, t, x, k * t.rowLength, out, k * t.rows, s);
    return;
  }
  if (!DEQUANT[t.type]) return checkSupported(t);
  if (s.pool && s.pool.matmul(t, x, T, out)) return;
  matmulRows(w, t, x, T, out, s.row, 0, t.rows);
}

/** Rows r0 .. r1 of a T-token product (r0 even); `row` holds two dequantized weight rows. */
export function matmulRows(w: WeightViews, t: TensorInfo, x: Float32Array, T: number, out: Float32Array,
  row: Float32Array, r0: number, r1: number): void {
  const n = t.rowLength, rows = t.rows;
  const f = DEQUANT[t.type];
  if (!f) return checkSupported(t);
  for (let r = r0, off = t.offset + r0 * t.rowBytes; r < r1; r += 2, off += 2 * t.rowBytes) {
    const pair = r + 1 < r1;
    f(w, off, n, row, 0);
    if (pair) f(w, off + t.rowBytes, n, row, n);
    let k = 0;
    for (; pair && k + 4 <= T; k += 4) {
      const x0 = k * n, x1 = x0 + n, x2 = x1 + n, x3 = x2 + n;
      let a0 = 0, a1 = 0, a2 = 0, a3 = 0, b0 = 0, b1 = 0, b2 = 0, b3 = 0;
      for (let i = 0; i < n; i++) {
        const wa = row[i], wb = row[n + i];
        const v0 = x[x0 + i], v1 = x[x1 + i], v2 = x[x2 + i], v3 = x[x3 + i];
        a0 += wa * v0; a1 += wa * v1; a2 += wa * v2; a3 += wa * v3;
        b0 += wb * v0; b1 += wb * v1; b2 += wb * v2; b3 += wb * v3;
      }
      out[k * rows + r] = a0; out[(k + 1) * rows + r] = a1; out[(k + 2) * rows + r] = a2; out[(k + 3) * rows + r] = a3;
      out[k * rows + r + 1] = b0; out[(k + 1) * rows + r + 1] = b1; out[(k + 2) * rows + r + 1] = b2;
      out[(k + 3) * rows + r + 1] = b3;
    }
    for (; k < T; k++) { // leftover tokens (and the last row of an odd-sized matrix)
      const xo = k * n;
      let a = 0, b = 0;
      for (let i = 0; i < n; i++) { a += row[i] * x[xo + i]; b += row[n + i] * x[xo + i]; }
      out[k * rows + r] = a;
      if (pair) out[k * rows + r + 1] = b;
    }
  }
}
