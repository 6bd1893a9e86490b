// Step 07 — K-quants: 256-weight super-blocks (Python: pyengine/gguf/quants.py Q4_K/Q6_K).
//
// SmolLM2's Q4_1 file does not use them, but mixed-quant files (e.g. Gemma 3 Q4_K_M) do.
//   Q4_K 144 B: f16 d | f16 dmin | u8 scales[12] | u8 qs[128]
//     8 sub-blocks of 32; sub-block j has a 6-bit scale sc_j and 6-bit min m_j packed in `scales`;
//     w = d*sc_j*q - dmin*m_j. qs chunk c (32 bytes) holds sub-block 2c in low nibbles, 2c+1 in high nibbles.
//   Q6_K 210 B: u8 ql[128] | u8 qh[64] | i8 scales[16] | f16 d
//     q = (4 low bits from ql) | (2 high bits from qh) << 4, w = d*scales[i/16]*(q-32).
//     For each half h (128 weights): element r<64 takes ql[64h+r] low nibble, r>=64 the high nibble of
//     ql[64h+r-64]; its high bits are (qh[32h + r%32] >> 2*(r/32)) & 3.

import type { WeightViews } from "./05_f16_bf16.js";

/** Unpack the 6-bit scale and min of sub-block j (0..7) from the 12 scale bytes at p. */
function scaleMin(u8: Uint8Array, p: number, j: number, out: Int32Array): void {
  if (j < 4) {
    out[0] = u8[p + j] & 63;
    out[1] = u8[p + j + 4] & 63;
  } else {
    out[0] = (u8[p + j + 4] & 15) | ((u8[p + j - 4] >>> 6) << 4);
    out[1] = (u8[p + j + 4] >>> 4) | ((u8[p + j] >>> 6) << 4);
  }
}

const sm = new Int32Array(2); // scratch for scaleMin (two ints, reused)

export function dotQ4_K(w: WeightViews, off: number, x: Float64Array, xsum: Float64Array, n: number): number {
  const u8 = w.u8, u16 = w.u16, half = w.half;
  let acc = 0;
  for (let i = 0; i < n; i += 256, off += 144) {
    const d = half[u16[off >>> 1]], dmin = half[u16[(off >>> 1) + 1]];
    for (let c = 0; c < 4; c++) {
      const q = off + 16 + 32 * c, lo = i + 64 * c, hi = lo + 32;
      let sl = 0, sh = 0;
      for (let l = 0; l < 32; l++) {
        const v = u8[q + l];
        sl += (v & 15) * x[lo + l];
        sh += (v >>> 4) * x[hi + l];
      }
      scaleMin(u8, off + 4, 2 * c, sm);
      acc += d * sm[0] * sl - dmin * sm[1] * xsum[lo >>> 5];
      scaleMin(u8, off + 4, 2 * c + 1, sm);
      acc += d * sm[0] * sh - dmin * sm[1] * xsum[hi >>> 5];
    }
  }
  return acc;
}

export function dequantQ4_K(w: WeightViews, off: number, n: number, out: Float32Array, o: number): void {
  const u8 = w.u8, u16 = w.u16, half = w.half;
  for (let i = 0; i < n; i += 256, off += 144) {
    const d = half[u16[off >>> 1]], dmin = half[u16[(off >>> 1) + 1]];
    for (let j = 0; j < 8; j++) {
      scaleMin(u8, off + 4, j, sm);
      const sc = Math.fround(d * sm[0]), mn = Math.fround(dmin * sm[1]);
      const q = off + 16 + 32 * (j >>> 1), shift = (j & 1) * 4;
      for (let l = 0; l < 32; l++) out[o + i + 32 * j + l] = Math.fround(sc * ((u8[q + l] >>> shift) & 15)) - mn;
    }
  }
}

export function dotQ6_K(w: WeightViews, off: number, x: Float64Array, n: number): number {
  const u8 = w.u8, i8 = w.i8, u16 = w.u16, half = w.half;
  let acc = 0;
  for (let i = 0; i < n; i += 256, off += 210) {
    const d = half[u16[(off + 208) >>> 1]];
    for (let h = 0; h < 2; h++) {
      const ql = off + 64 * h, qh = off + 128 + 32 * h;
      for (let g = 0; g < 8; g++) { // 8 groups of 16 weights share one scale
        let s = 0;
        for (let t = 0; t < 16; t++) {
          const r = 16 * g + t;
          const low = r < 64 ? u8[ql + r] & 15 : u8[ql + r - 64] >>> 4;
          const high = (u8[qh + (r & 31)] >>> (2 * (r >>> 5))) & 3;
          s += ((low | (high << 4)) - 32) * x[i + 128 * h + r];
        }
        acc += d * i8[off + 192 + 8 * h + g] * s;
      }
    }
  }
  return acc;
}

export function dequantQ6_K(w: WeightViews, off: number, n: number, out: Float32Array, o: number): void {
  const u8 = w.u8, i8 = w.i8, u16 = w.u16, half = w.half;
  for (let i = 0; i < n; i += 256, off += 210) {
    const d = half[u16[(off + 208) >>> 1]];
    for (let h = 0; h < 2; h++) {
      const ql = off + 64 * h, qh = off + 128 + 32 * h;
      for (let r = 0; r < 128; r++) {
        const low = r < 64 ? u8[ql + r] & 15 : u8[ql + r - 64] >>> 4;
        const high = (u8[qh + (r & 31)] >>> (2 * (r >>> 5))) & 3;
        const sc = Math.fround(d * i8[off + 192 + 8 * h + (r >>> 4)]);
        out[o + i + 128 * h + r] = sc * ((low | (high << 4)) - 32);
      }
    }
  }
}
