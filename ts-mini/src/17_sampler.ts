// Step 17 — sampling (Python: pyengine/layers/sampler.py, pyengine/sampling_params.py).
//
// Order, as in HF/vLLM: temperature -> top-k -> top-p -> draw. temperature <= 0 (or top-k = 1) is greedy.
// No per-token allocation: probabilities and candidate indices live in arena scratch. Nothing is sorted:
// top-k is a quickselect (the k most likely tokens, ties to the lower id), top-p a *weighted* quickselect
// (the smallest most-likely set holding top_p of the mass) — both O(V) on average, where sorting 49152
// probabilities every token would cost tens of milliseconds for flat distributions.

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

/**
 * Three-way partition of idx[lo, hi) by probs around `pivot`: [> pivot][= pivot][< pivot].
 * Returns [a, c]: the "=" run is idx[a, c).
 */
function partition(idx: Int32Array, probs: Float64Array, lo: number, hi: number, pivot: number): [number, number] {
  let a = lo, b = lo, c = hi;
  while (b < c) {
    const v = probs[idx[b]];
    if (v > pivot) { const t = idx[a]; idx[a++] = idx[b]; idx[b++] = t; }
    else if (v < pivot) { const t = idx[b]; idx[b] = idx[--c]; idx[c] = t; }
    else b++;
  }
  return [a, c];
}

function massOf(idx: Int32Array, probs: Float64Array, lo: number, hi: number): number {
  let s = 0;
  for (let j = lo; j < hi; j++) s += probs[idx[j]];
  return s;
}

/** Move the k most probable of idx[0, count) to idx[0, k) (ties broken toward the lower token id). */
export function selectTopK(idx: Int32Array, probs: Float64Array, count: number, k: number): number {
  if (k >= count) return count;
  let lo = 0, hi = count;
  while (lo < hi) {
    const [a, c] = partition(idx, probs, lo, hi, probs[idx[(lo + hi) >>> 1]]);
    if (a >= k) { hi = a; continue; } // the boundary is among the larger ones
    if (c >= k) { idx.subarray(a, c).sort(); return k; } // boundary inside a tie: lowest ids first
    lo = c;
  }
  return k;
}

/**
 * Nucleus: reorder idx[0, count) so idx[0, m) is the smallest set of most probable tokens whose mass reaches
 * `target` (the token that crosses it included; ties in id order), and return m.
 */
export function selectTopP(idx: Int32Array, probs: Float64Array, count: number, target: number): number {
  let lo = 0, hi = count, taken = 0; // idx[0, lo) is in the nucleus, worth `taken`
  while (lo < hi) {
    const [a, c] = partition(idx, probs, lo, hi, probs[idx[(lo + hi) >>> 1]]);
    const gt = massOf(idx, probs, lo, a);
    if (taken + gt >= target && a > lo) { hi = a; continue; } // the crossing token is among the larger ones
    const eq = massOf(idx, probs, a, c);
    if (taken + gt + eq >= target) {
      idx.subarray(a, c).sort();
      taken += gt;
      let j = a;
      while (j < c) { taken += probs[idx[j++]]; if (taken >= target) break; }
      return j;
    }
    taken += gt + eq;
    lo = c;
  }
  return lo;
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
    const p = Math.exp((logits[i] - max) * invT); // unnormalised: the draw scales by the kept mass
    probs[i] = p;
    total += p;
  }
  if (!(o.topK > 0 && o.topK < n) && o.topP >= 1) {
    let r = rng.next() * total;
    for (let i = 0; i < n; i++) { r -= probs[i]; if (r < 0) return i; }
    return argmax(logits, n); // rounding left r a hair above 0
  }
  for (let i = 0; i < n; i++) idx[i] = i;
  let count = n, mass = total;
  if (o.topK > 0 && o.topK < n) {
    count = selectTopK(idx, probs, n, o.topK);
    mass = massOf(idx, probs, 0, count);
  }
  if (o.topP < 1) {
    count = selectTopP(idx, probs, count, o.topP * mass);
    mass = massOf(idx, probs, 0, count);
  }
  let r = rng.next() * mass;
  for (let j = 0; j < count; j++) {
    r -= probs[idx[j]];
    if (r < 0) return idx[j];
  }
  return idx[count - 1];
}
