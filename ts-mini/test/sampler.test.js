// Sampling: checked against independent definitions (softmax, sorted cumulative mass) and statistics.
import { test } from "node:test";
import assert from "node:assert/strict";
import { Pcg64, lawExp, sample, checkSamplingOptions } from "../dist/17_sampler.js";

class Rng { constructor(seed) { this.g = new Pcg64(seed); } next() { return this.g.random(); } random() { return this.g.random(); } }

const scratch = (n) => ({ probs: new Float64Array(n), idx: new Int32Array(n), vals: new Float64Array(n) });

function softmax(logits, T) {
  const m = Math.max(...logits);
  const e = logits.map((l) => Math.exp((l - m) / T));
  const z = e.reduce((a, b) => a + b, 0);
  return e.map((v) => v / z);
}

/** Reference top-k/top-p support (docs/sampling.md, vLLM's semantics): sort by probability, keep the k largest
 * and every token tied with the k-th, then the shortest prefix reaching top_p and every token tied with its last. */
function referenceSupport(logits, { temperature, topK, topP }) {
  const p = softmax(logits, temperature);
  let order = p.map((v, i) => [v, i]).sort((a, b) => b[0] - a[0] || a[1] - b[1]);
  if (topK > 0 && topK < order.length) { const kth = order[topK - 1][0]; order = order.filter(([v]) => v >= kth); }
  const mass = order.reduce((a, [v]) => a + v, 0);
  const kept = [];
  let cum = 0, last = 0;
  for (const [v, i] of order) { kept.push(i); cum += v; last = v; if (cum >= topP * mass) break; }
  for (const [v, i] of order) if (v === last && !kept.includes(i)) kept.push(i);
  const km = kept.reduce((a, i) => a + p[i], 0);
  return new Map(kept.map((i) => [i, p[i] / km]));
}

/** Chi-square goodness of fit; the 0.9999 quantile bound keeps false failures negligible for a seeded run. */
function assertFits(counts, expected, draws, label) {
  let chi = 0, df = -1;
  for (const [i, p] of expected) {
    const e = p * draws;
    chi += ((counts.get(i) ?? 0) - e) ** 2 / e;
    df++;
  }
  for (const i of counts.keys()) assert.ok(expected.has(i), `${label}: sampled token ${i} outside the allowed set`);
  // Wilson–Hilferty approximation of the chi-square 0.9999 quantile
  const z = 3.719, k = Math.max(df, 1);
  const bound = k * (1 - 2 / (9 * k) + z * Math.sqrt(2 / (9 * k))) ** 3;
  assert.ok(chi < bound, `${label}: chi2 ${chi.toFixed(1)} >= ${bound.toFixed(1)} (df ${k})`);
}

function randomLogits(n, seed) {
  const r = new Rng(seed);
  return Array.from({ length: n }, () => (r.next() - 0.5) * 8);
}

test("Rng: seeded, reproducible, uniform in [0, 1)", () => {
  const a = new Rng(42), b = new Rng(42), c = new Rng(43);
  const xa = Array.from({ length: 5 }, () => a.next()), xb = Array.from({ length: 5 }, () => b.next());
  assert.deepEqual(xa, xb);
  assert.notDeepEqual(xa, Array.from({ length: 5 }, () => c.next()));
  const r = new Rng(7), bins = new Array(10).fill(0), N = 100000;
  for (let i = 0; i < N; i++) {
    const v = r.next();
    assert.ok(v >= 0 && v < 1);
    bins[Math.floor(v * 10)]++;
  }
  assertFits(new Map(bins.map((c, i) => [i, c])), new Map(bins.map((_, i) => [i, 0.1])), N, "uniform bins");
});

test("greedy: temperature 0 and top-k 1 both take the argmax", () => {
  const logits = Float32Array.from(randomLogits(1000, 1));
  const best = logits.indexOf(Math.max(...logits));
  const rng = new Rng(0), sc = scratch(1000);
  assert.equal(sample(logits, 1000, { temperature: 0, topK: 0, topP: 1 }, rng, sc), best);
  assert.equal(sample(logits, 1000, { temperature: 1.3, topK: 1, topP: 0.5 }, rng, sc), best);
});

const configs = [
  { temperature: 1, topK: 0, topP: 1 },
  { temperature: 0.7, topK: 5, topP: 1 },
  { temperature: 1.5, topK: 0, topP: 0.8 },
  { temperature: 1, topK: 8, topP: 0.6 },
];
for (const o of configs) {
  test(`sampling frequencies follow the filtered softmax (T=${o.temperature}, k=${o.topK}, p=${o.topP})`, () => {
    const n = 12;
    const logits = randomLogits(n, 11);
    const expected = referenceSupport(logits, o);
    const f32 = Float32Array.from(logits);
    const rng = new Rng(123), sc = scratch(n), counts = new Map(), draws = 40000;
    for (let i = 0; i < draws; i++) {
      const id = sample(f32, n, o, rng, sc);
      counts.set(id, (counts.get(id) ?? 0) + 1);
    }
    assertFits(counts, expected, draws, JSON.stringify(o));
  });
}

test("top-k / top-p over a full-size vocabulary: the sampled support equals the reference support", () => {
  const n = 49152;
  const logits = randomLogits(n, 5).map((v, i) => (i % 1000 === 0 ? v + 12 : v)); // a few strong tokens
  const f32 = Float32Array.from(logits);
  const sc = scratch(n);
  for (const o of [{ temperature: 1, topK: 20, topP: 1 }, { temperature: 0.8, topK: 0, topP: 0.9 }, { temperature: 1, topK: 40, topP: 0.5 }]) {
    const support = referenceSupport(Array.from(f32), o);
    const rng = new Rng(9), seen = new Set();
    for (let i = 0; i < 1500; i++) seen.add(sample(f32, n, o, rng, sc));
    for (const id of seen) assert.ok(support.has(id), `${JSON.stringify(o)}: ${id} not in support`);
    // every kept token with probability >= 1% shows up in 1500 draws (miss chance < 3e-7 each; seeded anyway)
    for (const [id, p] of support) if (p >= 0.01) assert.ok(seen.has(id), `${JSON.stringify(o)}: ${id} (p=${p}) never drawn`);
  }
});

test("same seed, same tokens; invalid options are rejected by name", () => {
  const logits = Float32Array.from(randomLogits(500, 3));
  const run = (seed) => { const r = new Rng(seed), sc = scratch(500); return Array.from({ length: 20 }, () => sample(logits, 500, { temperature: 1, topK: 50, topP: 0.9 }, r, sc)); };
  assert.deepEqual(run(5), run(5));
  assert.notDeepEqual(run(5), run(6));
  assert.throws(() => checkSamplingOptions({ temperature: NaN, topK: 0, topP: 1 }), /temperature/);
  assert.throws(() => checkSamplingOptions({ temperature: 1, topK: 2.5, topP: 1 }), /topK/);
  assert.throws(() => checkSamplingOptions({ temperature: 1, topK: 0, topP: 1.5 }), /topP/);
});

test("ties at the top-k and top-p cuts keep every tied token (Python's and vLLM's rule)", () => {
  // logits with few distinct values: the k-th largest and the token crossing top_p sit inside tie groups
  for (let trial = 0; trial < 12; trial++) {
    const n = 60 + trial * 7, r = new Rng(trial);
    const logits = Array.from({ length: n }, () => Math.floor(r.next() * 5) * 0.75);
    const o = { temperature: 1, topK: trial % 2 ? 1 + (trial * 5) % n : 0, topP: trial % 3 ? 0.35 + 0.1 * (trial % 5) : 1 };
    const support = referenceSupport(logits, o), f32 = Float32Array.from(logits), sc = scratch(n), seen = new Set();
    for (let i = 0; i < 4000; i++) seen.add(sample(f32, n, o, r, sc));
    for (const id of seen) assert.ok(support.has(id), `trial ${trial}: ${id} outside the support`);
    for (const id of support.keys()) assert.ok(seen.has(id), `trial ${trial}: tied token ${id} never drawn`);
  }
});

test("lawExp: close to Math.exp, exactly 1 at 0, monotone, 0 below the floor", () => {
  assert.equal(lawExp(0), 1);
  assert.equal(lawExp(-701), 0);
  assert.equal(lawExp(-Infinity), 0);
  let prev = 0;
  for (let d = -700; d <= 0; d += 0.0137) {
    const v = lawExp(d);
    assert.ok(Math.abs(v - Math.exp(d)) <= 4e-16 * Math.exp(d), `lawExp(${d})`);
    assert.ok(v >= prev);
    prev = v;
  }
});
