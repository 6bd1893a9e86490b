// Step 17 — sampling (Python: pyengine/layers/sampler.py, pyengine/sampling_params.py).
//
// Order, as in HF/vLLM: temperature -> top-k -> top-p -> draw. temperature <= 0 (or top-k = 1) is greedy.
// No per-token allocation: probabilities and candidate indices live in arena scratch. Sorting all 49152
// tokens every step would be slow, so only "candidates" are sorted: every token whose probability is at
// least a threshold. The threshold is lowered until the candidates hold >= k tokens (top-k) and >= top_p of
// the mass (top-p); every token outside is smaller than every token inside, so the result is exact.

import { argmax } from "./16_logits.js";

export interface SamplingOptions {
  temperature: number; // <= 0: greedy
  topK: number; // <= 0: off
  topP: number; // 1: off; must be in (0, 1]
}

export function checkSamplingOptions(o: SamplingOptions): void {
  if (!Number.isFinite(o.temperature) || o.temperature < 0) throw new RangeError(`temperature must be >= 0, got ${o.temperature}`);
  if (!Number.isInteger(o.topK) || o.topK < -1) throw new RangeError(`topK must be an integer >= -1 (<= 0 disables), got ${o.topK}`);
  if (!(o.topP > 0 && o.topP <= 1)) throw new RangeError(`topP must be in (0, 1], got ${o.topP}`);
}

/** Seeded PRNG: SplitMix32-style seeding into xoshiro128**; next() is uniform in [0, 1) with 53 bits. */
export class Rng {
  private s = new Uint32Array(4);

  constructor(seed: number) {
    let z = (Math.floor(seed) >>> 0) ^ Math.floor(seed / 2 ** 32);
    for (let i = 0; i < 4; i++) {
      z = (z + 0x9e3779b9) >>> 0;
      let t = z;
      t = Math.imul(t ^ (t >>> 16), 0x21f0aaad);
      t = Math.imul(t ^ (t >>> 15), 0x735a2d97);
      this.s[i] = (t ^ (t >>> 15)) >>> 0;
    }
    if ((this.s[0] | this.s[1] | this.s[2] | this.s[3]) === 0) this.s[0] = 1;
  }

  private nextU32(): number {
    const s = this.s;
    const result = Math.imul(rotl(Math.imul(s[1], 5), 7), 9) >>> 0;
    const t = s[1] << 9;
    s[2] ^= s[0]; s[3] ^= s[1]; s[1] ^= s[2]; s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 11);
    return result;
  }

  next(): number {
    return ((this.nextU32() >>> 5) * 67108864 + (this.nextU32() >>> 6)) / 9007199254740992;
  }
}

function rotl(x: number, k: number): number {
  return (x << k) | (x >>> (32 - k));
}

export interface SamplerScratch {
  probs: Float64Array; // >= vocab
  idx: Int32Array; // >= vocab
}

/** Draw a token id from logits[0..n) under temperature/top-k/top-p, using the arena scratch `sc`. */
export function sample(logits: Float32Array, n: number, o: SamplingOptions, rng: Rng, sc: SamplerScratch): number {
  if (o.temperature <= 0 || o.topK === 1) return argmax(logits, n);
  const probs = sc.probs, idx = sc.idx;
  let max = -Infinity;
  for (let i = 0; i < n; i++) if (logits[i] > max) max = logits[i];
  const invT = 1 / o.temperature;
  let total = 0;
  for (let i = 0; i < n; i++) {
    const p = Math.exp((logits[i] - max) * invT);
    probs[i] = p;
    total += p;
  }
  const k = o.topK > 0 ? Math.min(o.topK, n) : n;
  const filterK = k < n, filterP = o.topP < 1;

  let count = n;
  if (filterK || filterP) {
    // Largest probability is 1 (the max logit). Lower the threshold until the candidates suffice.
    for (let thr = 1e-4; ; thr *= 1e-4) {
      if (thr < 1e-300) thr = 0;
      count = 0;
      let mass = 0;
      for (let i = 0; i < n; i++) if (probs[i] >= thr) { idx[count++] = i; mass += probs[i]; }
      if ((count >= k || count === n) && (!filterP || mass >= o.topP * total || thr === 0)) break;
    }
    const cand = idx.subarray(0, count);
    cand.sort((a, b) => probs[b] - probs[a] || a - b);
    if (count > k) count = k;
    if (filterP) {
      let kept = 0;
      for (let j = 0; j < count; j++) kept += probs[idx[j]];
      const target = o.topP * kept;
      let cum = 0, j = 0;
      while (j < count) { cum += probs[idx[j++]]; if (cum >= target) break; }
      count = j;
    }
  } else {
    for (let i = 0; i < n; i++) idx[i] = i;
  }
  let mass = 0;
  for (let j = 0; j < count; j++) mass += probs[idx[j]];
  let r = rng.next() * mass;
  for (let j = 0; j < count; j++) {
    r -= probs[idx[j]];
    if (r < 0) return idx[j];
  }
  return idx[count - 1]; // rounding left r a hair above 0
}
