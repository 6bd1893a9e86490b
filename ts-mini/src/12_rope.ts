// Step 12 — rotary position embeddings (Python: pyengine/layers/rotary.py).
//
// Tables: for position p and pair i (0 <= i < hd/2), angle = p * base^(-2i/hd); cos/sin are precomputed once
// into the arena. Convention: llama.cpp's converter permutes the rows of Q and K in a GGUF llama so that the
// pairs to rotate are ADJACENT, (x[2i], x[2i+1]) — "normal" rope — which equals HF's rotate_half on the
// un-permuted weights. (NeoX-style models pair x[i] with x[i + hd/2]; not used here.)

export function fillRopeTables(cos: Float32Array, sin: Float32Array, maxPos: number, headDim: number, base: number,
  positionScale = 1): void {
  const half = headDim / 2;
  for (let i = 0; i < half; i++) {
    // float32 like the reference: inv_freq = 1 / base^(2i/hd)
    const invFreq = Math.fround(1 / Math.fround(base ** Math.fround((2 * i) / headDim)));
    for (let p = 0; p < maxPos; p++) {
      const angle = Math.fround(Math.fround(p / positionScale) * invFreq);
      cos[p * half + i] = Math.cos(angle);
      sin[p * half + i] = Math.sin(angle);
    }
  }
}

/** Rotate nHeads heads of x (at offset xo, head stride headDim) to position pos, in place. */
export function applyRope(x: Float32Array, xo: number, nHeads: number, headDim: number, pos: number,
  cos: Float32Array, sin: Float32Array): void {
  const half = headDim / 2, t = pos * half;
  for (let h = 0; h < nHeads; h++) {
    const base = xo + h * headDim;
    for (let i = 0; i < half; i++) {
      const c = cos[t + i], s = sin[t + i];
      const a = x[base + 2 * i], b = x[base + 2 * i + 1];
      x[base + 2 * i] = a * c - b * s;
      x[base + 2 * i + 1] = a * s + b * c;
    }
  }
}
