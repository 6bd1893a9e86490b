// Step 15 — the SwiGLU feed-forward nonlinearity (Python: pyengine/layers/activation.py silu / swiglu).
//
// FFN(x) = W_down · (silu(W_gate·x) ⊙ (W_up·x)), silu(g) = g·sigmoid(g). This step is the elementwise middle;
// the three projections are matmuls (step 13).

export function silu(g: number): number {
  return g / (1 + Math.exp(-g));
}

/** gate[i] <- silu(gate[i]) * up[i] for n elements (in place). */
export function swiglu(gate: Float32Array, up: Float32Array, n: number): void {
  for (let i = 0; i < n; i++) {
    const g = gate[i];
    gate[i] = Math.fround(g / (1 + Math.exp(-g))) * up[i];
  }
}

/** x[i] += y[i] — the residual connection. */
export function addInPlace(x: Float32Array, y: Float32Array, n: number): void {
  for (let i = 0; i < n; i++) x[i] += y[i];
}
