// Step 06 — 32-weight block quants: fused dequant-dot kernels (Python: pyengine/gguf/quants.py Q8_0/Q4_0/Q4_1/Q5_0).
//
// Block layouts (little-endian, f16 = half float):
//   Q8_0  34 B: f16 d | i8 q[32]                      w = d*q
//   Q4_0  18 B: f16 d | u8 qs[16]                     w = d*(q-8)
//   Q4_1  20 B: f16 d | f16 m | u8 qs[16]             w = d*q + m
//   Q5_0  22 B: f16 d | u32 qh | u8 qs[16]            w = d*((q | hbit<<4) - 16)
// In qs, byte j holds weight j in its low nibble and weight j+16 in its high nibble.
//
// A dot product never materialises the weights: per block, d*Σq·x (+ m·Σx). Σx per block ("xsum") is the same
// for every row, so the matvec computes it once. Q4_1 blocks are 20 bytes and the tensor is 32-aligned, so
// the 16 nibble bytes start on a 4-byte boundary: we read them as four u32 words.

import type { WeightViews } from "./05_f16_bf16.js";

/** Copy x (f32) into the f64 input scratch and compute its 32-element block sums. */
export function prepareInput(x: Float32Array, xo: number, n: number, xs: Float64Array, xsum: Float64Array): void {
  for (let b = 0, i = 0; i < n; b++) {
    let s = 0;
    for (const end = Math.min(i + 32, n); i < end; i++) {
      const v = x[xo + i];
      xs[i] = v;
      s += v;
    }
    xsum[b] = s;
  }
}

export function dotQ8_0(w: WeightViews, off: number, x: Float64Array, n: number): number {
  // Q8_0 blocks are 34 bytes, so the quants start on a 2-byte boundary: read them two at a time as i16 words
  // (low byte = even weight, high byte = odd weight; shifts sign-extend each byte).
  const q = w.i16, u16 = w.u16, half = w.half;
  let acc = 0;
  for (let i = 0, h = off >>> 1; i < n; i += 32, h += 17) {
    const d = half[u16[h]];
    let s = 0;
    for (let j = 0; j < 16; j += 2) {
      const v0 = q[h + 1 + j], v1 = q[h + 2 + j], k = i + 2 * j;
      s += ((v0 << 24) >> 24) * x[k] + (v0 >> 8) * x[k + 1] + ((v1 << 24) >> 24) * x[k + 2] + (v1 >> 8) * x[k + 3];
    }
    acc += d * s;
  }
  return acc;
}

export function dotQ4_0(w: WeightViews, off: number, x: Float64Array, xsum: Float64Array, n: number): number {
  const u8 = w.u8, u16 = w.u16, half = w.half;
  let acc = 0;
  for (let i = 0, b = 0; i < n; i += 32, b++, off += 18) {
    const d = half[u16[off >>> 1]];
    const p = off + 2;
    let s = 0;
    for (let j = 0; j < 16; j++) {
      const v = u8[p + j];
      s += (v & 15) * x[i + j] + (v >>> 4) * x[i + j + 16];
    }
    acc += d * (s - 8 * xsum[b]);
  }
  return acc;
}

export function dotQ4_1(w: WeightViews, off: number, x: Float64Array, xsum: Float64Array, n: number): number {
  const u32 = w.u32, u16 = w.u16, half = w.half;
  let acc = 0;
  let h = off >>> 1; // u16 index of the block's d (m follows)
  for (let i = 0, b = 0; i < n; i += 32, b++, h += 10) {
    const d = half[u16[h]], m = half[u16[h + 1]];
    const k = (h >>> 1) + 1; // u32 index of qs
    let s = 0;
    for (let j = 0; j < 4; j++) {
      const q = u32[k + j], lo = i + 4 * j, hi = lo + 16;
      s += (q & 15) * x[lo] + ((q >>> 8) & 15) * x[lo + 1] + ((q >>> 16) & 15) * x[lo + 2] + ((q >>> 24) & 15) * x[lo + 3]
        + ((q >>> 4) & 15) * x[hi] + ((q >>> 12) & 15) * x[hi + 1] + ((q >>> 20) & 15) * x[hi + 2] + (q >>> 28) * x[hi + 3];
    }
    acc += d * s + m * xsum[b];
  }
  return acc;
}

/**
 * Two consecutive rows at once (rows r and r+1, `rowBytes` apart): each x value loaded feeds both rows, which is
 * what bounds the single-row kernel. Results go to out[o] and out[o + 1].
 */
export function dotQ4_1x2(w: WeightViews, off: number, rowBytes: number, x: Float64Array, xsum: Float64Array, n: number,
  out: Float32Array, o: number): void {
  const u32 = w.u32, u16 = w.u16, half = w.half;
  let acc0 = 0, acc1 = 0;
  for (let i = 0, b = 0, h = off >>> 1, g = (off + rowBytes) >>> 1; i < n; i += 32, b++, h += 10, g += 10) {
    const k = (h >>> 1) + 1, l = (g >>> 1) + 1;
    let s0 = 0, s1 = 0;
    for (let j = 0; j < 4; j++) {
      const q = u32[k + j], p = u32[l + j], lo = i + 4 * j, hi = lo + 16;
      const x0 = x[lo], x1 = x[lo + 1], x2 = x[lo + 2], x3 = x[lo + 3];
      const y0 = x[hi], y1 = x[hi + 1], y2 = x[hi + 2], y3 = x[hi + 3];
      s0 += (q & 15) * x0 + ((q >>> 8) & 15) * x1 + ((q >>> 16) & 15) * x2 + ((q >>> 24) & 15) * x3
        + ((q >>> 4) & 15) * y0 + ((q >>> 12) & 15) * y1 + ((q >>> 20) & 15) * y2 + (q >>> 28) * y3;
      s1 += (p & 15) * x0 + ((p >>> 8) & 15) * x1 + ((p >>> 16) & 15) * x2 + ((p >>> 24) & 15) * x3
        + ((p >>> 4) & 15) * y0 + ((p >>> 12) & 15) * y1 + ((p >>> 20) & 15) * y2 + (p >>> 28) * y3;
    }
    acc0 += half[u16[h]] * s0 + half[u16[h + 1]] * xsum[b];
    acc1 += half[u16[g]] * s1 + half[u16[g + 1]] * xsum[b];
  }
  out[o] = acc0;
  out[o + 1] = acc1;
}

/** Q8_0, two rows at once (see dotQ4_1x2). */
export function dotQ8_0x2(w: WeightViews, off: number, rowBytes: number, x: Float64Array, n: number, out: Float32Array,
  o: number): void {
  const q = w.i16, u16 = w.u16, half = w.half;
  let acc0 = 0, acc1 = 0;
  for (let i = 0, h = off >>> 1, g = (off + rowBytes) >>> 1; i < n; i += 32, h += 17, g += 17) {
    let s0 = 0, s1 = 0;
    for (let j = 0; j < 16; j++) {
      const v = q[h + 1 + j], u = q[g + 1 + j], k = i + 2 * j, x0 = x[k], x1 = x[k + 1];
      s0 += ((v << 24) >> 24) * x0 + (v >> 8) * x1;
      s1 += ((u << 24) >> 24) * x0 + (u >> 8) * x1;
    }
    acc0 += half[u16[h]] * s0;
    acc1 += half[u16[g]] * s1;
  }
  out[o] = acc0;
  out[o + 1] = acc1;
}

// ---- integer kernels: activations quantized per 32-block, integer multiply-adds (llama.cpp's CPU idea) ----
//
// prepareInputInt turns x into integers per block: xq[i] = round(x[i] / xd[b]) with xd[b] = amax_b / qmax. The
// inner loops then do int32 products and sums (no int->double conversion per weight, which bounds the f64
// kernels) and each block costs one float multiply-add. qmax is as large as the int32 sum allows, so the
// result is as accurate as float32 input: Q4_1 nibbles (<= 15) x 32 weights x 2^22 < 2^31; Q8_0 quants
// (|q| <= 128) x 32 x 2^19 < 2^31. Σx per block stays the exact float sum (the Q4_1 min term).

export const QMAX_Q4 = 4194303; // 2^22 - 1
export const QMAX_Q8 = 524287; // 2^19 - 1

export function prepareInputInt(x: Float32Array, xo: number, n: number, qmax: number, xq: Int32Array, xd: Float64Array,
  xsum: Float64Array): void {
  for (let b = 0, i = 0; i < n; b++, i += 32) {
    const end = Math.min(i + 32, n);
    let amax = 0, s = 0;
    for (let k = i; k < end; k++) {
      const v = x[xo + k];
      s += v;
      const a = v < 0 ? -v : v;
      if (a > amax) amax = a;
    }
    const d = amax / qmax, inv = amax > 0 ? qmax / amax : 0;
    for (let k = i; k < end; k++) xq[k] = Math.round(x[xo + k] * inv);
    xd[b] = d;
    xsum[b] = s;
  }
}

/** Q4_1, two rows at once, integer inner loop (see dotQ4_1x2 for the layout). */
export function dotQ4_1x2i(w: WeightViews, off: number, rowBytes: number, xq: Int32Array, xd: Float64Array,
  xsum: Float64Array, n: number, out: Float32Array, o: number): void {
  const q32 = w.i32, u16 = w.u16, half = w.half;
  let acc0 = 0, acc1 = 0;
  for (let i = 0, b = 0, h = off >>> 1, g = (off + rowBytes) >>> 1; i < n; i += 32, b++, h += 10, g += 10) {
    const k = (h >>> 1) + 1, l = (g >>> 1) + 1;
    let s0 = 0, s1 = 0;
    for (let j = 0; j < 4; j++) {
      const q = q32[k + j], p = q32[l + j], lo = i + 4 * j, hi = lo + 16;
      const x0 = xq[lo], x1 = xq[lo + 1], x2 = xq[lo + 2], x3 = xq[lo + 3];
      const y0 = xq[hi], y1 = xq[hi + 1], y2 = xq[hi + 2], y3 = xq[hi + 3];
      s0 = (s0 + (q & 15) * x0 + ((q >>> 8) & 15) * x1 + ((q >>> 16) & 15) * x2 + ((q >>> 24) & 15) * x3
        + ((q >>> 4) & 15) * y0 + ((q >>> 12) & 15) * y1 + ((q >>> 20) & 15) * y2 + (q >>> 28) * y3) | 0;
      s1 = (s1 + (p & 15) * x0 + ((p >>> 8) & 15) * x1 + ((p >>> 16) & 15) * x2 + ((p >>> 24) & 15) * x3
        + ((p >>> 4) & 15) * y0 + ((p >>> 12) & 15) * y1 + ((p >>> 20) & 15) * y2 + (p >>> 28) * y3) | 0;
    }
    const dx = xd[b], sx = xsum[b];
    acc0 += half[u16[h]] * dx * s0 + half[u16[h + 1]] * sx;
    acc1 += half[u16[g]] * dx * s1 + half[u16[g + 1]] * sx;
  }
  out[o] = acc0;
  out[o + 1] = acc1;
}

export function dotQ4_1i(w: WeightViews, off: number, xq: Int32Array, xd: Float64Array, xsum: Float64Array,
  n: number): number {
  const q32 = w.i32, u16 = w.u16, half = w.half;
  let acc = 0;
  for (let i = 0, b = 0, h = off >>> 1; i < n; i += 32, b++, h += 10) {
    const k = (h >>> 1) + 1;
    let s = 0;
    for (let j = 0; j < 4; j++) {
      const q = q32[k + j], lo = i + 4 * j, hi = lo + 16;
      s = (s + (q & 15) * xq[lo] + ((q >>> 8) & 15) * xq[lo + 1] + ((q >>> 16) & 15) * xq[lo + 2]
        + ((q >>> 24) & 15) * xq[lo + 3] + ((q >>> 4) & 15) * xq[hi] + ((q >>> 12) & 15) * xq[hi + 1]
        + ((q >>> 20) & 15) * xq[hi + 2] + (q >>> 28) * xq[hi + 3]) | 0;
    }
    acc += half[u16[h]] * xd[b] * s + half[u16[h + 1]] * xsum[b];
  }
  return acc;
}

/** Q8_0, two rows at once, integer inner loop (the i16 words hold two quants each, as in dotQ8_0). */
export function dotQ8_0x2i(w: WeightViews, off: number, rowBytes: number, xq: Int32Array, xd: Float64Array, n: number,
  out: Float32Array, o: number): void {
  const q = w.i16, u16 = w.u16, half = w.half;
  let acc0 = 0, acc1 = 0;
  for (let i = 0, b = 0, h = off >>> 1, g = (off + rowBytes) >>> 1; i < n; i += 32, b++, h += 17, g += 17) {
    let s0 = 0, s1 = 0;
    for (let j = 0; j < 16; j += 2) {
      const v = q[h + 1 + j], u = q[g + 1 + j], V = q[h + 2 + j], U = q[g + 2 + j], k = i + 2 * j;
      const x0 = xq[k], x1 = xq[k + 1], x2 = xq[k + 2], x3 = xq[k + 3];
      s0 = (s0 + ((v << 24) >> 24) * x0 + (v >> 8) * x1 + ((V << 24) >> 24) * x2 + (V >> 8) * x3) | 0;
      s1 = (s1 + ((u << 24) >> 24) * x0 + (u >> 8) * x1 + ((U << 24) >> 24) * x2 + (U >> 8) * x3) | 0;
    }
    const dx = xd[b];
    acc0 += half[u16[h]] * dx * s0;
    acc1 += half[u16[g]] * dx * s1;
  }
  out[o] = acc0;
  out[o + 1] = acc1;
}

export function dotQ8_0i(w: WeightViews, off: number, xq: Int32Array, xd: Float64Array, n: number): number {
  const q = w.i16, u16 = w.u16, half = w.half;
  let acc = 0;
  for (let i = 0, b = 0, h = off >>> 1; i < n; i += 32, b++, h += 17) {
    let s = 0;
    for (let j = 0; j < 16; j++) {
      const v = q[h + 1 + j], k = i + 2 * j;
      s = (s + ((v << 24) >> 24) * xq[k] + (v >> 8) * xq[k + 1]) | 0;
    }
    acc += half[u16[h]] * xd[b] * s;
  }
  return acc;
}

// ---- Q4_1 by table lookup: one load per weight byte instead of two multiply-adds ----
//
// For each block b and byte position p (0..15) of the block's nibble bytes, lut[(16b + p)·256 + v] =
// (v & 15)·xq[32b + p] + (v >> 4)·xq[32b + p + 16]: the integer partial dot of ANY byte value v at that position.
// Building it costs 4096 stores per block, so it pays only when many rows share the input (a tall matrix:
// 13_matmul.ts uses it from LUT_MIN_ROWS rows, for rows of at most LUT_MAX_IN); the sums are the same integers
// as dotQ4_1i's, so the results are bit-identical. Measured by `npm run bench`.

export const LUT_MIN_ROWS = 1024;
export const LUT_MAX_IN = 1024;

export function buildQ4Lut(xq: Int32Array, n: number, lut: Int32Array): void {
  for (let b = 0; b < n / 32; b++) {
    for (let p = 0; p < 16; p++) {
      const x0 = xq[32 * b + p], x1 = xq[32 * b + p + 16], base = (16 * b + p) * 256;
      for (let hi = 0; hi < 16; hi++) {
        const h = hi * x1, o = base + 16 * hi;
        for (let lo = 0; lo < 16; lo++) lut[o + lo] = h + lo * x0;
      }
    }
  }
}

export function dotQ4_1lut(w: WeightViews, off: number, lut: Int32Array, xd: Float64Array, xsum: Float64Array,
  n: number): number {
  const q32 = w.i32, u16 = w.u16, half = w.half;
  let acc = 0;
  for (let b = 0, h = off >>> 1, base = 0; b < n / 32; b++, h += 10, base += 4096) {
    const k = (h >>> 1) + 1;
    const q0 = q32[k], q1 = q32[k + 1], q2 = q32[k + 2], q3 = q32[k + 3];
    const s = (lut[base + (q0 & 255)] + lut[base + 256 + ((q0 >>> 8) & 255)] + lut[base + 512 + ((q0 >>> 16) & 255)]
      + lut[base + 768 + (q0 >>> 24)] + lut[base + 1024 + (q1 & 255)] + lut[base + 1280 + ((q1 >>> 8) & 255)]
      + lut[base + 1536 + ((q1 >>> 16) & 255)] + lut[base + 1792 + (q1 >>> 24)] + lut[base + 2048 + (q2 & 255)]
      + lut[base + 2304 + ((q2 >>> 8) & 255)] + lut[base + 2560 + ((q2 >>> 16) & 255)] + lut[base + 2816 + (q2 >>> 24)]
      + lut[base + 3072 + (q3 & 255)] + lut[base + 3328 + ((q3 >>> 8) & 255)] + lut[base + 3584 + ((q3 >>> 16) & 255)]
      + lut[base + 3840 + (q3 >>> 24)]) | 0;
    acc += half[u16[h]] * xd[b] * s + half[u16[h + 1]] * xsum[b];
  }
  return acc;
}

function readU32(u8: Uint8Array, p: number): number {
  return (u8[p] | (u8[p + 1] << 8) | (u8[p + 2] << 16) | (u8[p + 3] << 24)) >>> 0;
}

export function dotQ5_0(w: WeightViews, off: number, x: Float64Array, xsum: Float64Array, n: number): number {
  const u8 = w.u8, u16 = w.u16, half = w.half;
  let acc = 0;
  for (let i = 0, b = 0; i < n; i += 32, b++, off += 22) {
    const d = half[u16[off >>> 1]];
    const qh = readU32(u8, off + 2); // 22-byte blocks: only 2-aligned, so assemble the word from bytes
    const p = off + 6;
    let s = 0;
    for (let j = 0; j < 16; j++) {
      const v = u8[p + j];
      s += ((v & 15) | (((qh >>> j) & 1) << 4)) * x[i + j] + ((v >>> 4) | (((qh >>> (j + 16)) & 1) << 4)) * x[i + j + 16];
    }
    acc += d * (s - 16 * xsum[b]);
  }
  return acc;
}

// Dequantisers (one row into `out` at `o`): used for the embedding lookup, the prefill matmul and the tests.

export function dequantQ8_0(w: WeightViews, off: number, n: number, out: Float32Array, o: number): void {
  const q = w.i8, u16 = w.u16, half = w.half;
  for (let i = 0; i < n; i += 32, off += 34) {
    const d = half[u16[off >>> 1]];
    for (let j = 0; j < 32; j++) out[o + i + j] = d * q[off + 2 + j];
  }
}

export function dequantQ4_0(w: WeightViews, off: number, n: number, out: Float32Array, o: number): void {
  const u8 = w.u8, u16 = w.u16, half = w.half;
  for (let i = 0; i < n; i += 32, off += 18) {
    const d = half[u16[off >>> 1]];
    for (let j = 0; j < 16; j++) {
      const v = u8[off + 2 + j];
      out[o + i + j] = d * ((v & 15) - 8);
      out[o + i + j + 16] = d * ((v >>> 4) - 8);
    }
  }
}

export function dequantQ4_1(w: WeightViews, off: number, n: number, out: Float32Array, o: number): void {
  const u8 = w.u8, u16 = w.u16, half = w.half;
  for (let i = 0; i < n; i += 32, off += 20) {
    const d = half[u16[off >>> 1]], m = half[u16[(off >>> 1) + 1]];
    for (let j = 0; j < 16; j++) {
      const v = u8[off + 4 + j];
      // Math.fround(d*q) then + m mirrors the float32 arithmetic of the reference dequantiser exactly.
      out[o + i + j] = Math.fround(d * (v & 15)) + m;
      out[o + i + j + 16] = Math.fround(d * (v >>> 4)) + m;
    }
  }
}

export function dequantQ5_0(w: WeightViews, off: number, n: number, out: Float32Array, o: number): void {
  const u8 = w.u8, u16 = w.u16, half = w.half;
  for (let i = 0; i < n; i += 32, off += 22) {
    const d = half[u16[off >>> 1]];
    const qh = readU32(u8, off + 2);
    for (let j = 0; j < 16; j++) {
      const v = u8[off + 6 + j];
      out[o + i + j] = d * (((v & 15) | (((qh >>> j) & 1) << 4)) - 16);
      out[o + i + j + 16] = d * (((v >>> 4) | (((qh >>> (j + 16)) & 1) << 4)) - 16);
    }
  }
}
