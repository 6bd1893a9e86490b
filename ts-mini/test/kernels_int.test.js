// The integer kernels (activations quantized per 32-block, int32 multiply-adds) against dequantized rows · x in
// float64, on the model's own Q4_1 and Q8_0 tensors, including odd rows, row ranges and extreme inputs.
import { test } from "node:test";
import assert from "node:assert/strict";
import { parseGGUF } from "../dist/index.js";
import { fillHalfTable, makeWeightViews } from "../dist/05_f16_bf16.js";
import { dequantRow, matvec, matvecRows, prepareMatvec, useLut } from "../dist/13_matmul.js";
import { QMAX_Q4, QMAX_Q8 } from "../dist/06_q8_q4_dot.js";
import { GGMLType } from "../dist/04_tensor_table.js";
import { NO_MODEL, modelBuffer } from "./helpers.js";

const half = fillHalfTable(new Float32Array(65536));

function input(n, seed, kind) {
  const x = new Float32Array(n);
  let s = seed >>> 0;
  for (let i = 0; i < n; i++) {
    s = (Math.imul(s, 1664525) + 1013904223) >>> 0;
    const u = s / 2 ** 32 - 0.5;
    x[i] = kind === "spiky" ? (i % 97 === 0 ? 300 * u : u * 1e-3) : kind === "zeros" ? (i < 64 ? 0 : u) : u;
  }
  return x;
}

function scratch(n) {
  return { xs: new Float64Array(n), xsum: new Float64Array(n / 32), row: new Float32Array(2 * n),
    xq: new Int32Array(n), xd: new Float64Array(n / 32) };
}

test("integer matvec = dequantized rows · x (Q4_1 and Q8_0, ordinary, spiky and zero blocks)", { skip: NO_MODEL }, () => {
  const g = parseGGUF(modelBuffer());
  const w = makeWeightViews(g.buffer, half);
  for (const name of ["blk.3.ffn_down.weight", "blk.0.attn_v.weight", "token_embd.weight"]) {
    const t = g.tensors.get(name);
    const n = t.rowLength, rows = Math.min(t.rows, 301); // an odd row count: the single-row tail runs too
    const sub = { ...t, rows };
    const row = new Float32Array(n);
    for (const kind of ["plain", "spiky", "zeros"]) {
      const x = input(n, 5, kind), y = new Float32Array(rows);
      matvec(w, sub, x, 0, y, 0, scratch(n));
      for (let r = 0; r < rows; r++) {
        dequantRow(w, t, r, row, 0);
        // Rounding each x to the block's integer grid moves it by at most half a step (amax_b / qmax / 2):
        // the error bound is Σ_b step_b/2 · Σ_{i in b} |w_i|, plus the float32 rounding of the result.
        const qmax = t.type === GGMLType.Q4_1 ? QMAX_Q4 : QMAX_Q8;
        let ref = 0, bound = 0;
        for (let b = 0; b < n; b += 32) {
          let amax = 0, wsum = 0;
          for (let i = b; i < b + 32; i++) { ref += row[i] * x[i]; amax = Math.max(amax, Math.abs(x[i])); wsum += Math.abs(row[i]); }
          bound += (amax / qmax / 2) * wsum * (1 + 1e-9);
        }
        bound += Math.abs(ref) * 2 ** -24 + 1e-12;
        assert.ok(Math.abs(y[r] - ref) <= bound, `${name} ${kind} row ${r}: ${y[r]} vs ${ref} (bound ${bound})`);
      }
    }
  }
});

test("matvecRows over disjoint even ranges reassembles the whole matvec exactly", { skip: NO_MODEL }, () => {
  const g = parseGGUF(modelBuffer());
  const w = makeWeightViews(g.buffer, half);
  const t = g.tensors.get("blk.1.ffn_gate.weight"), n = t.rowLength;
  const x = input(n, 9, "plain"), s = scratch(n);
  const whole = new Float32Array(t.rows), parts = new Float32Array(t.rows);
  matvec(w, t, x, 0, whole, 0, s);
  prepareMatvec(t, x, 0, s);
  for (const [a, b] of [[0, 500], [500, 1000], [1000, t.rows]]) matvecRows(w, t, parts, 0, s, a, b);
  assert.deepEqual(parts, whole);
});

test("Q4_1 table-lookup matvec (tall matrices) is bit-identical to the integer kernel", { skip: NO_MODEL }, () => {
  const g = parseGGUF(modelBuffer());
  const w = makeWeightViews(g.buffer, half);
  for (const name of ["blk.2.ffn_up.weight", "blk.7.ffn_gate.weight"]) {
    const t = g.tensors.get(name), n = t.rowLength;
    const x = input(n, 13, "spiky"), s = scratch(n);
    const withLut = { ...scratch(n), lut: new Int32Array((n / 32) * 4096) };
    assert.ok(useLut(t, withLut) && !useLut(t, s));
    const a = new Float32Array(t.rows), b = new Float32Array(t.rows);
    matvec(w, t, x, 0, a, 0, s);
    matvec(w, t, x, 0, b, 0, withLut);
    assert.deepEqual(b, a);
    const short = { ...t, rows: 100 }; // below LUT_MIN_ROWS: the table is not used
    assert.ok(!useLut(short, withLut));
  }
});
