// Step 16 — final norm and logits (Python: pyengine/models/llama.py, the output head).
//
// logits = W_out · rmsnorm(x_last). SmolLM2 ties W_out to the token embedding (no output.weight tensor), so
// the quantized embedding table doubles as the output projection and is read in place once per token.

import type { TensorInfo } from "./04_tensor_table.js";
import type { WeightViews } from "./05_f16_bf16.js";
import { rmsnorm } from "./11_embed_rmsnorm.js";
import { MatScratch, matvec } from "./13_matmul.js";

export function computeLogits(w: WeightViews, output: TensorInfo, outputNorm: Float32Array, eps: number,
  x: Float32Array, xo: number, normed: Float32Array, logits: Float32Array, s: MatScratch): void {
  const d = output.rowLength;
  rmsnorm(normed, 0, x, xo, outputNorm, d, eps);
  matvec(w, output, normed, 0, logits, 0, s);
}

export function argmax(logits: Float32Array, n: number): number {
  let best = 0, bestV = logits[0];
  for (let i = 1; i < n; i++) if (logits[i] > bestV) { bestV = logits[i]; best = i; }
  return best;
}
