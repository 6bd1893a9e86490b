// Step 13 — matrix-vector and matrix-matrix products over quantized weights (Python: pyengine/models/llama.py
// linear layers, via pyengine/gguf/quants.py dequantize).
//
// matvec (decode, one token): out[r] = Σ_i W[r,i]·x[i] with the fused dequant-dot kernels — the weights are
// read once per token straight from the GGUF buffer.
// matmul (prefill, T tokens): each weight row is dequantized once into a scratch row and dotted with all T
// inputs, so the unpacking cost is shared by the whole chunk.

import { GGUFError } from "./02_gguf_header.js";
import { GGMLType, TensorInfo, typeName } from "./04_tensor_table.js";
import { WeightViews, dequantBF16, dequantF16, dequantF32, dotBF16, dotF16, dotF32 } from "./05_f16_bf16.js";
import {
  dequantQ4_0, dequantQ4_1, dequantQ5_0, dequantQ8_0, dotQ4_0, dotQ4_1, dotQ5_0, dotQ8_0, prepareInput,
} from "./06_q8_q4_dot.js";
import { dequantQ4_K, dequantQ6_K, dotQ4_K, dotQ6_K } from "./07_kquants.js";

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

/** Scratch a matvec/matmul needs: f64 copy of the input and its 32-element block sums. */
export interface MatScratch {
  xs: Float64Array; // >= max input length
  xsum: Float64Array; // >= max input length / 32
  row: Float32Array; // >= max input length (prefill: one dequantized weight row)
}

/** out[oo + r] = W[r,:] · x[xo .. xo + n) for every row r of W. */
export function matvec(w: WeightViews, t: TensorInfo, x: Float32Array, xo: number, out: Float32Array, oo: number,
  s: MatScratch): void {
  const n = t.rowLength, rows = t.rows, rb = t.rowBytes;
  const xs = s.xs, xsum = s.xsum;
  prepareInput(x, xo, n, xs, xsum);
  let off = t.offset;
  switch (t.type) {
    case GGMLType.Q4_1: for (let r = 0; r < rows; r++, off += rb) out[oo + r] = dotQ4_1(w, off, xs, xsum, n); break;
    case GGMLType.Q8_0: for (let r = 0; r < rows; r++, off += rb) out[oo + r] = dotQ8_0(w, off, xs, n); break;
    case GGMLType.Q4_0: for (let r = 0; r < rows; r++, off += rb) out[oo + r] = dotQ4_0(w, off, xs, xsum, n); break;
    case GGMLType.Q5_0: for (let r = 0; r < rows; r++, off += rb) out[oo + r] = dotQ5_0(w, off, xs, xsum, n); break;
    case GGMLType.Q4_K: for (let r = 0; r < rows; r++, off += rb) out[oo + r] = dotQ4_K(w, off, xs, xsum, n); break;
    case GGMLType.Q6_K: for (let r = 0; r < rows; r++, off += rb) out[oo + r] = dotQ6_K(w, off, xs, n); break;
    case GGMLType.F32: for (let r = 0; r < rows; r++, off += rb) out[oo + r] = dotF32(w, off, xs, n); break;
    case GGMLType.F16: for (let r = 0; r < rows; r++, off += rb) out[oo + r] = dotF16(w, off, xs, n); break;
    case GGMLType.BF16: for (let r = 0; r < rows; r++, off += rb) out[oo + r] = dotBF16(w, off, xs, n); break;
    default: checkSupported(t);
  }
}

/**
 * T tokens at once: x is [T, n] (row stride n), out is [T, rows] (row stride rows).
 * Each weight row is dequantized once and reused for all T tokens.
 */
export function matmul(w: WeightViews, t: TensorInfo, x: Float32Array, T: number, out: Float32Array,
  s: MatScratch): void {
  if (T === 1) return matvec(w, t, x, 0, out, 0, s);
  const n = t.rowLength, rows = t.rows;
  const f = DEQUANT[t.type];
  if (!f) return checkSupported(t);
  const row = s.row;
  for (let r = 0, off = t.offset; r < rows; r++, off += t.rowBytes) {
    f(w, off, n, row, 0);
    let k = 0;
    // Four tokens per pass: each weight read from `row` feeds four products.
    for (; k + 4 <= T; k += 4) {
      const x0 = k * n, x1 = x0 + n, x2 = x1 + n, x3 = x2 + n;
      let a0 = 0, a1 = 0, a2 = 0, a3 = 0;
      for (let i = 0; i < n; i++) {
        const wi = row[i];
        a0 += wi * x[x0 + i];
        a1 += wi * x[x1 + i];
        a2 += wi * x[x2 + i];
        a3 += wi * x[x3 + i];
      }
      out[k * rows + r] = a0;
      out[(k + 1) * rows + r] = a1;
      out[(k + 2) * rows + r] = a2;
      out[(k + 3) * rows + r] = a3;
    }
    for (; k < T; k++) {
      const xo = k * n;
      let acc = 0;
      for (let i = 0; i < n; i++) acc += row[i] * x[xo + i];
      out[k * rows + r] = acc;
    }
  }
}
