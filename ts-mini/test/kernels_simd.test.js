// The WebAssembly SIMD kernels (13c_simd.ts) against the JS integer kernels of step 06: the same integers and
// the same float64 scale arithmetic, so every output must be bit-identical — on the model's own Q4_1 and
// Q8_0 tensors, odd row counts, row ranges, spiky and zero blocks; and a model with and without them decodes
// the same greedy tokens (the threaded pool with them too).
import { test } from "node:test";
import assert from "node:assert/strict";
import { loadModel, loadModelFromBlob, loadModelThreaded, parseGGUF, simdAvailable, SimdKernels } from "../dist/index.js";
import { fillHalfTable, makeWeightViews } from "../dist/05_f16_bf16.js";
import { matvec, matvecRows, prepareMatvec } from "../dist/13_matmul.js";
import { simdModuleBytes } from "../dist/13c_simd.js";
import { NO_MODEL, modelBuffer } from "./helpers.js";

const half = fillHalfTable(new Float32Array(65536));
const NO_SIMD = typeof WebAssembly !== "object" || !WebAssembly.validate(simdModuleBytes(false));

function input(n, seed, kind) {
  const x = new Float32Array(n);
  let s = seed >>> 0;
  for (let i = 0; i < n; i++) {
    s = (Math.imul(s, 1664525) + 1013904223) >>> 0;
    const u = s / 2 ** 32 - 0.5;
    x[i] = kind === "spiky" ? (i % 97 === 0 ? 300 * u : u * 1e-3) : kind === "zeros" ? (i < 64 ? 0 : u) : kind === "max" ? (i % 2 ? -1 : 1) : u;
  }
  return x;
}

const scratch = (n) => ({ xs: new Float64Array(n), xsum: new Float64Array(n / 32), row: new Float32Array(2 * n),
  xq: new Int32Array(n), xd: new Float64Array(n / 32) });

test("simdAvailable agrees with WebAssembly.validate of the module", () => {
  assert.equal(simdAvailable(), !NO_SIMD);
});

test("SIMD matvec is bit-identical to the JS integer kernels (Q4_1, Q8_0; plain, spiky, zero, extreme blocks)",
  { skip: NO_MODEL || NO_SIMD }, () => {
    const buf = modelBuffer();
    const g = parseGGUF(buf);
    const w = makeWeightViews(buf, half);
    const k = SimdKernels.create(buf, 1536, 49152, false);
    const ws = makeWeightViews(k.buffer, half);
    for (const name of ["blk.3.ffn_down.weight", "blk.0.ffn_up.weight", "blk.0.attn_v.weight", "token_embd.weight"]) {
      const t = g.tensors.get(name);
      assert.ok(k.serves(t), name);
      const n = t.rowLength, rows = name === "token_embd.weight" ? 4097 : t.rows - 1; // odd counts
      const sub = { ...t, rows };
      for (const kind of ["plain", "spiky", "zeros", "max"]) {
        const x = input(n, 11, kind), a = new Float32Array(rows + 3), b = new Float32Array(rows + 3);
        matvec(w, sub, x, 0, a, 3, scratch(n));
        matvec(ws, sub, x, 0, b, 3, { ...scratch(n), simd: k });
        for (let r = 0; r < rows + 3; r++) assert.ok(Object.is(a[r], b[r]), `${name} ${kind} row ${r}: ${a[r]} vs ${b[r]}`);
        // row ranges (what a pool thread runs) reassemble the same vector
        const c = new Float32Array(rows + 3), s = { ...scratch(n), simd: k };
        prepareMatvec(sub, x, 0, s);
        for (const [r0, r1] of [[0, 100], [100, 101], [101, rows]]) matvecRows(ws, sub, c, 3, s, r0, r1);
        for (let r = 3; r < rows + 3; r++) assert.ok(Object.is(a[r], c[r]), `${name} ${kind} ranges row ${r}`);
      }
    }
  });

test("a model with SIMD kernels decodes the tokens it decodes without them, on 1 and 2 threads",
  { skip: NO_MODEL || NO_SIMD }, async () => {
    const buf = modelBuffer();
    const plain = loadModel(buf.slice(0), { simd: false });
    const fast = loadModel(buf.slice(0));
    assert.equal(plain.model.simd, null);
    assert.ok(fast.model.simd);
    assert.ok(fast.gguf.buffer.byteLength > buf.byteLength); // the GGUF now lives in the kernels' memory
    const ids = plain.encode("The capital of France is");
    const want = plain.generate(ids, { maxTokens: 8, ignoreEos: true, temperature: 0 }).tokenIds;
    assert.deepEqual(fast.generate(ids, { maxTokens: 8, ignoreEos: true, temperature: 0 }).tokenIds, want);
    const pooled = await loadModelThreaded(buf.slice(0), { threads: 2 });
    try {
      assert.equal(pooled.threads, 2, pooled.threadNote ?? "");
      assert.ok(pooled.model.simd);
      assert.deepEqual(pooled.generate(ids, { maxTokens: 8, ignoreEos: true, temperature: 0 }).tokenIds, want);
    } finally {
      pooled.close();
    }
  });

test("a GGUF read into SimdKernels.reserve's memory is used in place; a Blob loads that way, on 1 and 2 threads",
  { skip: NO_MODEL || NO_SIMD }, async () => {
    const buf = modelBuffer();
    const into = SimdKernels.reserve(buf.byteLength, false);
    into.set(new Uint8Array(buf));
    assert.equal(SimdKernels.create(into.buffer, 1536, 49152, false, buf.byteLength).buffer, into.buffer); // no copy
    const big = SimdKernels.create(into.buffer, 1536, 1 << 20, false, buf.byteLength); // more scratch than reserved
    assert.notEqual(big.buffer, into.buffer);
    assert.deepEqual(new Uint8Array(big.buffer, 0, buf.byteLength), new Uint8Array(buf));
    const ref = loadModel(buf.slice(0));
    const ids = ref.encode("The capital of France is");
    const want = ref.generate(ids, { maxTokens: 8, ignoreEos: true, temperature: 0 }).tokenIds;
    for (const threads of [1, 2]) {
      const e = await loadModelFromBlob(new Blob([buf]), { threads });
      try {
        assert.equal(e.threads, threads, e.threadNote ?? "");
        assert.equal(e.gguf.byteLength, buf.byteLength);
        assert.equal(e.model.simd.buffer, e.gguf.buffer);
        // the reserved memory (the file + 2 MiB of room, in 64 KiB pages), not a copy sized to the layout
        assert.equal(e.gguf.buffer.byteLength, Math.ceil((buf.byteLength + (2 << 20)) / 65536) * 65536);
        assert.deepEqual(e.generate(ids, { maxTokens: 8, ignoreEos: true, temperature: 0 }).tokenIds, want);
      } finally {
        e.close();
      }
    }
    await assert.rejects(loadModelFromBlob(new Blob([buf.slice(0, 4096)]), { threads: 1 }), /truncated GGUF/);
  });
