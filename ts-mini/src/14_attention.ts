// Step 14 — KV cache and grouped-query attention (Python: pyengine/layers/attention.py, plain softmax attention;
// pyengine/engine/kv_cache.py for the cache).
//
// The cache is two arena views, K and V, laid out [layer][position][kvDim]. A new token's K/V are written at
// its position, then its query attends over positions 0..pos (causal by construction).
// GQA: H query heads share Hkv key/value heads; query head h reads KV head floor(h / (H / Hkv)).

export interface KVCache {
  k: Float32Array;
  v: Float32Array;
  maxSeq: number;
  kvDim: number;
}

export function storeKV(c: KVCache, layer: number, pos: number, k: Float32Array, ko: number, v: Float32Array,
  vo: number): void {
  const at = (layer * c.maxSeq + pos) * c.kvDim;
  c.k.set(k.subarray(ko, ko + c.kvDim), at);
  c.v.set(v.subarray(vo, vo + c.kvDim), at);
}

/**
 * out[oo ..] = softmax(q·Kᵀ / sqrt(hd)) · V for each query head, over the first nPos cached positions.
 * `scores` (length >= nPos) and `acc` (length >= headDim) are float64 scratch.
 */
export function attend(out: Float32Array, oo: number, q: Float32Array, qo: number, c: KVCache, layer: number,
  nPos: number, nHeads: number, nKvHeads: number, headDim: number, scores: Float64Array, acc: Float64Array): void {
  const group = nHeads / nKvHeads, kvDim = c.kvDim, K = c.k, V = c.v;
  const base = layer * c.maxSeq * kvDim;
  const scale = 1 / Math.sqrt(headDim);
  for (let h = 0; h < nHeads; h++) {
    const qh = qo + h * headDim;
    const kvOff = base + Math.floor(h / group) * headDim;
    let max = -Infinity;
    for (let t = 0; t < nPos; t++) {
      const kt = kvOff + t * kvDim;
      let s = 0;
      for (let i = 0; i < headDim; i++) s += q[qh + i] * K[kt + i];
      s *= scale;
      scores[t] = s;
      if (s > max) max = s;
    }
    let sum = 0;
    for (let t = 0; t < nPos; t++) {
      const e = Math.exp(scores[t] - max);
      scores[t] = e;
      sum += e;
    }
    for (let i = 0; i < headDim; i++) acc[i] = 0;
    for (let t = 0; t < nPos; t++) {
      const p = scores[t], vt = kvOff + t * kvDim;
      for (let i = 0; i < headDim; i++) acc[i] += p * V[vt + i];
    }
    const oh = oo + h * headDim, inv = 1 / sum;
    for (let i = 0; i < headDim; i++) out[oh + i] = acc[i] * inv;
  }
}
