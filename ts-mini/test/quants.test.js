// Dequantization and fused dot kernels against values the `gguf` package computed (test/fixtures/quant_fixture.json,
// made by scripts/make_quant_fixture.py; values are float32 written with 9 significant digits, so Math.fround
// restores them exactly).
import { test } from "node:test";
import assert from "node:assert/strict";
import { parseGGUF } from "../dist/index.js";
import { GGMLType, GGML_BLOCK } from "../dist/04_tensor_table.js";
import { fillHalfTable, halfToFloat, bf16ToFloat, makeWeightViews } from "../dist/05_f16_bf16.js";
import { dequantRow, matvec, matmul } from "../dist/13_matmul.js";
import { NO_MODEL, fixture, modelBuffer } from "./helpers.js";

const FIX = fixture("quant_fixture.json");
const half = fillHalfTable(new Float32Array(65536));

function seededX(n, seed) {
  let s = seed >>> 0;
  const x = new Float32Array(n);
  for (let i = 0; i < n; i++) {
    s = (Math.imul(s, 1664525) + 1013904223) >>> 0;
    x[i] = s / 2 ** 32 - 0.5;
  }
  return x;
}

function dot64(a, b) {
  let s = 0;
  for (let i = 0; i < a.length; i++) s += a[i] * b[i];
  return s;
}

test("f16/bf16 conversion: exact on special and ordinary values", () => {
  const cases = [[0x0000, 0], [0x8000, -0], [0x3c00, 1], [0xc000, -2], [0x7bff, 65504], [0x0001, 2 ** -24],
    [0x03ff, 1023 * 2 ** -24], [0x7c00, Infinity], [0xfc00, -Infinity], [0x3555, 0.333251953125]];
  for (const [h, v] of cases) assert.ok(Object.is(halfToFloat(h), v), `f16 ${h.toString(16)}`);
  assert.ok(Number.isNaN(halfToFloat(0x7e00)));
  // Cross-check against the platform's f32 for every half: the value must round-trip through Math.fround.
  for (let h = 0; h < 65536; h += 7) if (!Number.isNaN(half[h])) assert.equal(half[h], Math.fround(halfToFloat(h)));
  assert.equal(bf16ToFloat(0x3f80), 1);
  assert.equal(bf16ToFloat(0xc0a0), -5);
});

for (const b of FIX.blocks) {
  test(`${b.type} raw blocks (${b.source}): dequant and fused dot match the gguf package`, () => {
    const raw = Uint8Array.from(Buffer.from(b.raw, "base64"));
    const type = GGMLType[b.type];
    const [bs, bb] = GGML_BLOCK[type];
    assert.equal(raw.length, (b.n / bs) * bb);
    // Place the row at a 32-aligned offset of a fresh buffer, as in a GGUF tensor.
    const buf = new ArrayBuffer(64 + raw.length + 8);
    new Uint8Array(buf).set(raw, 64);
    const w = makeWeightViews(buf, half);
    const t = { name: b.type, type, offset: 64, rowLength: b.n, rows: 1, rowBytes: raw.length };
    const out = new Float32Array(b.n);
    dequantRow(w, t, 0, out, 0);
    for (let i = 0; i < b.n; i++) assert.equal(out[i], Math.fround(b.values[i]), `${b.type} element ${i}`);
    const x = seededX(b.n, 7);
    const y = new Float32Array(1);
    const scratch = { xs: new Float64Array(b.n), xsum: new Float64Array(b.n / 32), row: new Float32Array(2 * b.n) };
    matvec(w, t, x, 0, y, 0, scratch);
    const ref = dot64(b.values, x);
    assert.ok(Math.abs(y[0] - ref) <= 1e-5 * (1 + Math.abs(ref)), `${b.type} dot ${y[0]} vs ${ref}`);
    // prefill path on a 1-row matrix (the odd-row tail) with 6 tokens (one 4-token tile + 2 leftovers)
    const X = seededX(6 * b.n, 11), Y = new Float32Array(6);
    matmul(w, t, X, 6, Y, scratch);
    for (let k = 0; k < 6; k++) {
      const r = dot64(b.values, X.subarray(k * b.n, (k + 1) * b.n));
      assert.ok(Math.abs(Y[k] - r) <= 1e-5 * (1 + Math.abs(r)), `${b.type} matmul token ${k}`);
    }
  });
}

test("real SmolLM2 rows (Q8_0 embedding, Q4_1 weights, F32 norm) dequantize exactly as gguf does", { skip: NO_MODEL }, () => {
  const g = parseGGUF(modelBuffer());
  const w = makeWeightViews(g.buffer, half);
  for (const t of FIX.tensors) {
    const info = g.tensors.get(t.name);
    const out = new Float32Array(info.rowLength);
    t.rows.forEach((r, k) => {
      dequantRow(w, info, r, out, 0);
      for (let i = 0; i < out.length; i++) assert.equal(out[i], Math.fround(t.values[k][i]), `${t.name} row ${r} element ${i}`);
    });
  }
});

test("matvec (fused) and matmul (prefill) agree with dequantized rows · x on real tensors", { skip: NO_MODEL }, () => {
  const g = parseGGUF(modelBuffer());
  const w = makeWeightViews(g.buffer, half);
  for (const name of ["blk.0.attn_k.weight", "blk.5.ffn_down.weight"]) {
    const t = g.tensors.get(name);
    const n = t.rowLength, T = 5;
    const x = seededX(n * T, 3);
    const scratch = { xs: new Float64Array(n), xsum: new Float64Array(n / 32), row: new Float32Array(2 * n) };
    const y1 = new Float32Array(t.rows), yT = new Float32Array(t.rows * T), row = new Float32Array(n);
    matvec(w, t, x, n * 2, y1, 0, scratch); // token 2 of the batch
    matmul(w, t, x, T, yT, scratch);
    for (let r = 0; r < t.rows; r++) {
      dequantRow(w, t, r, row, 0);
      for (let k = 0; k < T; k++) {
        const ref = dot64(row, x.subarray(k * n, (k + 1) * n));
        assert.ok(Math.abs(yT[k * t.rows + r] - ref) <= 1e-5 * (1 + Math.abs(ref)), `${name} matmul row ${r} tok ${k}`);
        if (k === 2) assert.ok(Math.abs(y1[r] - ref) <= 1e-5 * (1 + Math.abs(ref)), `${name} matvec row ${r}`);
      }
    }
  }
});

test("dequantRow names the tensor on a bad row index", () => {
  const t = { name: "w", type: GGMLType.F32, offset: 0, rowLength: 4, rows: 2, rowBytes: 16 };
  const w = makeWeightViews(new ArrayBuffer(32), half);
  assert.throws(() => dequantRow(w, t, 2, new Float32Array(4), 0), /row 2 out of range for tensor "w"/);
});
