// Step 11 — token embedding and RMSNorm (Python: pyengine/layers/norm.py rms_norm; embedding lookup in
// pyengine/models/llama.py).
//
// The embedding table stays quantized: looking up a token dequantizes just its row.
// RMSNorm: y = x / sqrt(mean(x²) + eps) * w — the sum of squares is accumulated in float64.

import type { TensorInfo } from "./04_tensor_table.js";
import type { WeightViews } from "./05_f16_bf16.js";
import { dequantRow } from "./13_matmul.js";

export function embed(w: WeightViews, table: TensorInfo, tokenId: number, out: Float32Array, o: number): void {
  if (!Number.isInteger(tokenId) || tokenId < 0 || tokenId >= table.rows) {
    throw new RangeError(`token id ${tokenId} out of range 0..${table.rows - 1}`);
  }
  dequantRow(w, table, tokenId, out, o);
}

export function rmsnorm(out: Float32Array, oo: number, x: Float32Array, xo: number, weight: Float32Array, n: number,
  eps: number): void {
  let ss = 0;
  for (let i = 0; i < n; i++) ss += x[xo + i] * x[xo + i];
  const scale = 1 / Math.sqrt(ss / n + eps);
  for (let i = 0; i < n; i++) out[oo + i] = weight[i] * Math.fround(x[xo + i] * scale);
}
