// Sampling: checked against independent definitions (softmax, sorted cumulative mass) and statistics.
import { test } from "node:test";
import assert from "node:assert/strict";
import { Rng, sample, checkSamplingOptions, selectTopK, selectTopP } from "../dist/17_sampler.js";

const scratch = (n) => ({ probs: new Float64Array(n), idx: new Int32Array(n) });

function softmax(logits, T) {
  const m = Math.max(...logits);
  const e = logits.map((l) => Math.exp((l - m) / T));
  const z = e.reduce((a, b) => a + b, 0);
  return e.map((v) => v / z);
}

/** Reference top-k/top-p support: sort by probability, keep k, then the shortest prefix reaching top_p. */
function referenceSupport(logits, { temperature, topK, topP }) {
  const p = softmax(logits, temperature);
  let order = p.map((v, i) => [v, i]).sort((a, b) => b[0] - a[0] || a[1] - b[1]);
  if (topK > 0) order = order.slice(0, topK);
  const mass = order.reduce((a, [v]) => a + v, 0);
  const kept = [];
  let cum = 0;
  for (const [v, i] of order) { kept.push(i); cum += v; if (cum >= topP * mass) break; }
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

test("selectTopK / selectTopP pick exactly the reference sets, ties broken toward lower ids", () => {
  for (let trial = 0; trial < 40; trial++) {
    const n = 200 + trial * 37;
    // few distinct values -> many ties
    const r = new Rng(trial);
    const probs = Float64Array.from({ length: n }, () => Math.floor(r.next() * 6) / 6 + 0.01);
    const order = Array.from(probs, (v, i) => [v, i]).sort((a, b) => b[0] - a[0] || a[1] - b[1]).map(([, i]) => i);
    const k = 1 + (trial * 13) % n;
    const idx = Int32Array.from({ length: n }, (_, i) => i);
    assert.equal(selectTopK(idx, probs, n, k), k);
    assert.deepEqual([...idx.subarray(0, k)].sort((a, b) => a - b), order.slice(0, k).sort((a, b) => a - b), `top-k trial ${trial}`);
    const total = probs.reduce((a, b) => a + b, 0), target = ((trial % 9) + 1) / 10 * total;
    let cum = 0, m = 0;
    while (m < n) { cum += probs[order[m++]]; if (cum >= target) break; }
    const idx2 = Int32Array.from({ length: n }, (_, i) => i);
    const got = selectTopP(idx2, probs, n, target);
    assert.equal(got, m, `top-p size trial ${trial}`);
    assert.deepEqual([...idx2.subarray(0, got)].sort((a, b) => a - b), order.slice(0, m).sort((a, b) => a - b), `top-p trial ${trial}`);
  }
});
