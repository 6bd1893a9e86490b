// Step 17 — sampling (Python: pyengine/layers/sampler.py, pyengine/sampling_params.py). The sampling law of
// docs/sampling.md, implemented twice: the same seed gives the same tokens here and in NumPy (CPython, Pyodide).
//
//   scores x = logits (float64)  -> logit bias -> repetition penalty -> presence/frequency penalties
//   greedy (temperature < 1e-5): the first argmax of x
//   else x / T -> top-k (ties with the k-th kept) -> top-p (ties with the last kept kept) -> min-p -> draw
//
// Every weight comes from lawExp (IEEE +, -, *, floor and an exact power of two: no Math.exp, whose last bit
// differs from NumPy's), every sum runs left to right in float64, and the draw walks the kept tokens in
// ascending id order against one uniform double of NumPy's PCG64 stream (Pcg64 below, seeded like
// np.random.default_rng(seed)). Identical logits in, identical token out, by construction.

export const GREEDY_EPS = 1e-5; // pyengine/sampling_params.py GREEDY_EPS
export const TOP_P_CANDIDATES = 512; // the nucleus is first looked for among this many largest weights

export interface SamplingOptions {
  temperature: number; // < 1e-5: greedy
  topK: number; // <= 0: off
  topP: number; // 1: off; must be in (0, 1]
  minP?: number; // 0: off; in [0, 1]
  repetitionPenalty?: number; // 1: off; > 0
  presencePenalty?: number; // 0: off; in [-2, 2]
  frequencyPenalty?: number; // 0: off; in [-2, 2]
  logitBias?: Record<number, number> | null; // token id -> bias in [-100, 100]
}

export function checkSamplingOptions(o: SamplingOptions, vocabSize = Infinity): void {
  if (!Number.isFinite(o.temperature) || o.temperature < 0) throw new RangeError(`temperature must be >= 0, got ${o.temperature}`);
  if (!Number.isInteger(o.topK) || o.topK < -1) throw new RangeError(`topK must be an integer >= -1 (<= 0 disables), got ${o.topK}`);
  if (!(o.topP > 0 && o.topP <= 1)) throw new RangeError(`topP must be in (0, 1], got ${o.topP}`);
  const minP = o.minP ?? 0, rep = o.repetitionPenalty ?? 1;
  if (!(minP >= 0 && minP <= 1)) throw new RangeError(`minP must be in [0, 1], got ${o.minP}`);
  if (!(rep > 0) || !Number.isFinite(rep)) throw new RangeError(`repetitionPenalty must be positive, got ${o.repetitionPenalty}`);
  for (const [name, v] of [["presencePenalty", o.presencePenalty ?? 0], ["frequencyPenalty", o.frequencyPenalty ?? 0]] as const) {
    if (!(v >= -2 && v <= 2)) throw new RangeError(`${name} must be in [-2, 2], got ${v}`);
  }
  for (const [key, b] of Object.entries(o.logitBias ?? {})) {
    const t = Number(key);
    if (!Number.isInteger(t) || t < 0 || t >= vocabSize) throw new RangeError(`logitBias token id ${key} out of range`);
    if (typeof b !== "number" || !(Math.abs(b) <= 100)) throw new RangeError(`logitBias[${key}] must be in [-100, 100], got ${b}`);
  }
}

// ---- the PRNG: NumPy's SeedSequence + PCG64 (XSL-RR 128/64), BigInt arithmetic ----

const M32 = 0xffffffff;
const M64 = (1n << 64n) - 1n;
const M128 = (1n << 128n) - 1n;
const PCG_MULT = (2549297995355413924n << 64n) + 4865540595714422341n;

function mul32(a: number, b: number): number {
  return Math.imul(a, b) >>> 0;
}

function words32(n: bigint): number[] {
  const out: number[] = [];
  do { out.push(Number(n & 0xffffffffn)); n >>= 32n; } while (n > 0n);
  return out;
}

/** NumPy's SeedSequence(entropy, spawn_key).generate_state(4, uint64): four 64-bit words. */
export function seedSequenceState(entropy: bigint, spawnKey: number[] = []): bigint[] {
  let run = words32(entropy);
  const spawn = spawnKey.flatMap((k) => words32(BigInt(k)));
  if (spawn.length && run.length < 4) run = run.concat(new Array(4 - run.length).fill(0));
  const ent = run.concat(spawn);
  let hc = 0x43b0d7e5;
  const hashmix = (v: number): number => {
    v = (v ^ hc) >>> 0;
    hc = mul32(hc, 0x931e8875);
    v = mul32(v, hc);
    return (v ^ (v >>> 16)) >>> 0;
  };
  const mix = (x: number, y: number): number => {
    const r = (mul32(0xca01f9dd, x) - mul32(0x4973f715, y)) >>> 0;
    return (r ^ (r >>> 16)) >>> 0;
  };
  const pool = [0, 1, 2, 3].map((i) => hashmix(i < ent.length ? ent[i] : 0));
  for (let s = 0; s < 4; s++) for (let d = 0; d < 4; d++) if (s !== d) pool[d] = mix(pool[d], hashmix(pool[s]));
  for (let s = 4; s < ent.length; s++) for (let d = 0; d < 4; d++) pool[d] = mix(pool[d], hashmix(ent[s]));
  let hb = 0x8b51f9dd;
  const w: number[] = [];
  for (let i = 0; i < 8; i++) {
    let v = (pool[i % 4] ^ hb) >>> 0;
    hb = mul32(hb, 0x58f38ded);
    v = mul32(v, hb);
    w.push((v ^ (v >>> 16)) >>> 0);
  }
  void M32;
  return [0, 1, 2, 3].map((i) => BigInt(w[2 * i]) | (BigInt(w[2 * i + 1]) << 32n));
}

/** np.random.default_rng(seed) (spawnKey [] ) or default_rng(SeedSequence(seed, spawn_key)): random() is
 * NumPy's Generator.random(), bit for bit: (next64 >> 11) * 2^-53. */
export class Pcg64 {
  private state = 0n;
  private readonly inc: bigint;

  constructor(seed: number | bigint, spawnKey: number[] = []) {
    const s = BigInt(seed);
    if (s < 0n) throw new RangeError(`seed must be a non-negative integer, got ${seed}`);
    const v = seedSequenceState(s, spawnKey);
    const initState = (v[0] << 64n) | v[1], initSeq = (v[2] << 64n) | v[3];
    this.inc = ((initSeq << 1n) | 1n) & M128;
    this.step();
    this.state = (this.state + initState) & M128;
    this.step();
  }

  private step(): void {
    this.state = (this.state * PCG_MULT + this.inc) & M128;
  }

  nextU64(): bigint {
    this.step();
    const hi = this.state >> 64n, lo = this.state & M64;
    const rot = hi >> 58n, x = hi ^ lo;
    return ((x >> rot) | (x << ((64n - rot) & 63n))) & M64;
  }

  random(): number {
    return Number(this.nextU64() >> 11n) / 9007199254740992;
  }
}

/** The stream of choice `index` of a seeded request (0 = the plain seed), as pyengine's make_rng. */
export function streamFor(seed: number, index = 0): Pcg64 {
  return index === 0 ? new Pcg64(seed) : new Pcg64(seed, [index]);
}

// ---- the law's exponential (pyengine/layers/sampler.py law_exp) ----

const LN2_HI = 6.93147180369123816490e-01;
const LN2_LO = 1.90821492927058770002e-10;
const INV_LN2 = 1.44269504088896338700e+00;
export const LAW_EXP_FLOOR = -700;
const EXP_COEFS: number[] = [];
for (let n = 13; n >= 0; n--) { let f = 1; for (let i = 2; i <= n; i++) f *= i; EXP_COEFS.push(1 / f); }
// 2^k for k in [-1010, 0], written bit by bit (exponent field k + 1023, mantissa 0): exact, looked up per weight
const POW2 = new Float64Array(1011);
{
  const bits = new DataView(new ArrayBuffer(8));
  for (let k = -1010; k <= 0; k++) {
    bits.setUint32(0, (k + 1023) << 20); // big-endian: the high word carries sign, exponent and top mantissa
    bits.setUint32(4, 0);
    POW2[k + 1010] = bits.getFloat64(0);
  }
}

/** exp(d) for d <= 0 from exact IEEE operations only; d < -700 (or NaN) gives 0. */
export function lawExp(d: number): number {
  if (!(d >= LAW_EXP_FLOOR)) return 0;
  const k = Math.floor(d * INV_LN2 + 0.5);
  const r = (d - k * LN2_HI) - k * LN2_LO;
  let p = EXP_COEFS[0];
  for (let i = 1; i < EXP_COEFS.length; i++) p = p * r + EXP_COEFS[i];
  return p * POW2[k + 1010]; // k >= -1010 since d >= -700
}

// ---- the pipeline ----

export interface SamplerScratch {
  probs: Float64Array; // >= vocab: the scores x, then weights
  idx: Int32Array; // >= vocab: the live token ids, ascending
  vals: Float64Array; // >= vocab: sorting / selection workspace
}

/** The k-th largest of vals[0, n) (k = 1: the maximum), counting duplicates; reorders vals. */
function kthLargest(vals: Float64Array, n: number, k: number): number {
  let lo = 0, hi = n - 1;
  const want = k - 1; // index in descending order
  while (lo < hi) {
    const pivot = vals[(lo + hi) >>> 1];
    let i = lo, j = hi;
    while (i <= j) {
      while (vals[i] > pivot) i++;
      while (vals[j] < pivot) j--;
      if (i <= j) { const t = vals[i]; vals[i] = vals[j]; vals[j] = t; i++; j--; }
    }
    if (want <= j) hi = j;
    else if (want >= i) lo = i;
    else return vals[want];
  }
  return vals[want];
}

/** The weight of the last token the nucleus keeps, for the live weights w[idx[0, count)] (ascending ids). */
function topPCutoff(w: Float64Array, idx: Int32Array, count: number, p: number, vals: Float64Array): number {
  let total = 0;
  for (let j = 0; j < count; j++) total += w[idx[j]];
  const target = p * total;
  let m = TOP_P_CANDIDATES;
  for (;;) {
    let n = 0;
    if (4 * m >= count) {
      for (let j = 0; j < count; j++) vals[n++] = w[idx[j]];
    } else {
      for (let j = 0; j < count; j++) vals[j] = w[idx[j]];
      const thr = kthLargest(vals, count, m);
      for (let j = 0; j < count; j++) if (w[idx[j]] >= thr) vals[n++] = w[idx[j]]; // the m largest and their ties
    }
    const top = vals.subarray(0, n).sort(); // ascending: walk from the end
    let before = 0, keep = 0;
    for (let j = n - 1; j >= 0 && before < target; j--) { keep++; before += top[j]; }
    if (keep < n || n === count) return top[n - Math.max(keep, 1)];
    m *= 8;
  }
}

/** The processed scores x (bias, penalties) of one row, in sc.probs[0, n). */
function processScores(logits: Float32Array, n: number, o: SamplingOptions, promptIds: ArrayLike<number>,
                       outputIds: ArrayLike<number>, x: Float64Array): void {
  for (let i = 0; i < n; i++) x[i] = logits[i];
  if (o.logitBias) for (const [key, b] of Object.entries(o.logitBias)) x[Number(key)] += b;
  const rep = o.repetitionPenalty ?? 1;
  if (rep !== 1) {
    const seen = new Set<number>();
    for (let i = 0; i < promptIds.length; i++) seen.add(promptIds[i]);
    for (let i = 0; i < outputIds.length; i++) seen.add(outputIds[i]);
    for (const t of seen) x[t] = x[t] > 0 ? x[t] / rep : x[t] * rep;
  }
  const pres = o.presencePenalty ?? 0, freq = o.frequencyPenalty ?? 0;
  if ((pres || freq) && outputIds.length) {
    const counts = new Map<number, number>();
    for (let i = 0; i < outputIds.length; i++) counts.set(outputIds[i], (counts.get(outputIds[i]) ?? 0) + 1);
    for (const [t, c] of counts) x[t] -= freq * c + pres;
  }
}

/**
 * Draw a token id from logits[0..n) under the law (docs/sampling.md), with `rng`'s next double (greedy rows
 * draw none). promptIds / outputIds feed the penalties.
 */
export function sample(logits: Float32Array, n: number, o: SamplingOptions, rng: Pcg64, sc: SamplerScratch,
                       promptIds: ArrayLike<number> = [], outputIds: ArrayLike<number> = []): number {
  const x = sc.probs, idx = sc.idx, vals = sc.vals;
  processScores(logits, n, o, promptIds, outputIds, x);
  if (o.temperature < GREEDY_EPS) {
    let best = 0;
    for (let i = 1; i < n; i++) if (x[i] > x[best]) best = i;
    return best;
  }
  const T = o.temperature;
  let max = -Infinity;
  for (let i = 0; i < n; i++) { x[i] = x[i] / T; if (x[i] > max) max = x[i]; }
  let count = 0;
  if (o.topK > 0 && o.topK < n) { // keep every token tied with the k-th largest
    for (let i = 0; i < n; i++) vals[i] = x[i];
    const kth = kthLargest(vals, n, o.topK);
    for (let i = 0; i < n; i++) if (x[i] >= kth) idx[count++] = i;
  } else {
    for (let i = 0; i < n; i++) idx[i] = i;
    count = n;
  }
  for (let i = 0; i < n; i++) x[i] = lawExp(x[i] - max); // weights; the top token weighs exactly 1
  if (o.topP < 1) {
    const cut = topPCutoff(x, idx, count, o.topP, vals);
    let c = 0;
    for (let j = 0; j < count; j++) if (x[idx[j]] >= cut) idx[c++] = idx[j];
    count = c;
  }
  const minP = o.minP ?? 0;
  let total = 0;
  for (let j = 0; j < count; j++) {
    const t = idx[j];
    if (minP > 0 && !(x[t] >= minP)) x[t] = 0;
    total += x[t];
  }
  const r = rng.random() * total;
  let acc = 0, last = -1;
  for (let j = 0; j < count; j++) {
    const t = idx[j];
    acc += x[t];
    if (acc > r) return t;
    if (x[t] > 0) last = t;
  }
  return last; // u * total rounded up to the total: the last token of positive weight
}
