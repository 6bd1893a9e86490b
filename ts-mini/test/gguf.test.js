// GGUF parsing: the real file against what the `gguf` package reads (fixture), and clear errors on bad input.
import { test } from "node:test";
import assert from "node:assert/strict";
import { GGUFError, parseGGUF, loadModel } from "../dist/index.js";
import { typeName, GGMLType } from "../dist/04_tensor_table.js";
import { checkSupported } from "../dist/13_matmul.js";
import { ArenaLayout, Arena } from "../dist/01_arena.js";
import { GGUFBuilder, NO_MODEL, fixture, modelBuffer } from "./helpers.js";

const FIX = fixture("quant_fixture.json");

test("real GGUF header, metadata and tensor table match the gguf package", { skip: NO_MODEL }, () => {
  const g = parseGGUF(modelBuffer());
  const h = FIX.header;
  assert.equal(g.version, h.version);
  assert.equal(g.tensors.size, h.tensor_count);
  assert.equal(g.metadata.size + 3, h.kv_count + 3); // gguf counts the same kv pairs
  assert.equal(g.alignment, h.alignment);
  for (const t of h.tensors) {
    const ours = g.tensors.get(t.name);
    assert.ok(ours, t.name);
    assert.deepEqual(ours.shape, t.shape, t.name);
    assert.equal(typeName(ours.type), t.type, t.name);
    assert.equal(ours.offset, t.offset, t.name);
    assert.equal(ours.nbytes, t.nbytes, t.name);
  }
  assert.equal(g.metadata.get("general.architecture"), "llama");
  assert.equal(g.metadata.get("llama.block_count"), 30);
  assert.equal(g.metadata.get("tokenizer.ggml.tokens").length, 49152);
  assert.equal(g.metadata.get("tokenizer.ggml.token_type").length, 49152);
});

function header(b, { version = 3, tensors = 0, kvs = 0 } = {}) {
  return b.u32(0x46554747).u32(version).u64(tensors).u64(kvs);
}

/** A valid 1-tensor file: F32 [2, 32] named "w". */
function validFile({ type = GGMLType.F32, ne = [32, 2], dataBytes = 256, nDims = null, extraKV = null } = {}) {
  const b = header(new GGUFBuilder(), { tensors: 1, kvs: extraKV ? 2 : 1 });
  b.str("general.alignment").u32(4).u32(32);
  if (extraKV) extraKV(b);
  b.str("w").u32(nDims ?? ne.length);
  for (const n of ne) b.u64(n);
  b.u32(type).u64(0);
  b.pad(32);
  b.bytes(new Uint8Array(dataBytes));
  return b.build();
}

test("a minimal hand-built GGUF parses", () => {
  const g = parseGGUF(validFile());
  const t = g.tensors.get("w");
  assert.deepEqual(t.shape, [2, 32]);
  assert.equal(t.nbytes, 256);
  assert.equal(t.offset % 32, 0);
});

const cases = [
  ["empty buffer", () => new ArrayBuffer(0), /not a GGUF file/],
  ["wrong magic", () => new GGUFBuilder().u32(0x46554746).u32(3).u64(0).u64(0).build(), /not a GGUF file: magic bytes/],
  ["unsupported version", () => header(new GGUFBuilder(), { version: 7 }).build(), /unsupported GGUF version 7/],
  ["header cut short", () => new GGUFBuilder().u32(0x46554747).u32(3).u32(0).build(), /truncated GGUF: need 8 bytes for tensor_count/],
  ["absurd tensor count", () => header(new GGUFBuilder(), { tensors: 2 ** 40 }).build(), /tensor_count .* cannot fit/],
  ["unknown metadata value type", () => header(new GGUFBuilder(), { kvs: 1 }).str("k").u32(42).build(), /"k" has unknown value type 42/],
  ["string longer than the file", () => header(new GGUFBuilder(), { kvs: 1 }).str("k").u32(8).u64(1e6).build(), /truncated GGUF: need 1000000 bytes for "k"/],
  ["bad bool", () => header(new GGUFBuilder(), { kvs: 1 }).str("k").u32(7).u8(5).build(), /"k" is a bool with byte value 5/],
  ["array length beyond file", () => header(new GGUFBuilder(), { kvs: 1 }).str("a").u32(9).u32(5).u64(1e9).build(), /array "a" claims 1000000000 elements/],
  ["bad alignment", () => header(new GGUFBuilder(), { kvs: 1 }).str("general.alignment").u32(4).u32(3).build(), /general.alignment 3/],
  ["unknown ggml type", () => validFile({ type: 99 }), /tensor "w" has unknown ggml type 99/],
  ["too many dims", () => validFile({ nDims: 7, ne: [1, 1, 1, 1, 1, 1, 1] }), /tensor "w" has 7 dimensions/],
  ["tensor data past end of file", () => validFile({ dataBytes: 100 }), /truncated GGUF: tensor "w" needs bytes/],
  ["row not a whole number of blocks", () => validFile({ type: GGMLType.Q4_1, ne: [48, 2] }), /row length 48 is not a multiple of Q4_1 block size 32/],
];
for (const [name, make, re] of cases) {
  test(`corrupt input: ${name} -> GGUFError`, () => {
    assert.throws(() => parseGGUF(make()), (e) => e instanceof GGUFError && re.test(e.message) || assert.fail(`${e.name}: ${e.message}`));
  });
}

test("every truncation of the real file's header region is a clear GGUFError", { skip: NO_MODEL }, () => {
  const full = new Uint8Array(modelBuffer());
  // cut inside: magic, counts, the first key, the token list, the merges, the tensor table, tensor data
  for (const n of [3, 10, 23, 40, 5000, 700000, 1500000, 1785000, 40000000]) {
    const cut = full.slice(0, n).buffer;
    assert.throws(() => parseGGUF(cut), (e) => e instanceof GGUFError && /GGUF/.test(e.message), `cut at ${n}`);
  }
});

test("loadModel rejects non-ArrayBuffers and non-llama files clearly", () => {
  assert.throws(() => loadModel(new Uint8Array(8)), /expects an ArrayBuffer/);
  for (const arch of ["gemma3", "qwen2", "qwen3", "gemma2", "phi3"]) {   // the Python engine runs these; ts-mini does not
    const g = header(new GGUFBuilder(), { kvs: 1 }).str("general.architecture").u32(8).str(arch).build();
    assert.throws(() => loadModel(g), new RegExp(`ts-mini runs llama-architecture models, this file is "${arch}"`));
  }
});

test("unsupported tensor types are named", () => {
  const t = { name: "blk.0.attn_q.weight", type: GGMLType.Q2_K };
  assert.throws(() => checkSupported(t), /"blk.0.attn_q.weight" has ggml type Q2_K, which ts-mini cannot compute with/);
});

test("arena: one buffer, aligned non-overlapping views, checked names and kinds", () => {
  const L = new ArenaLayout().add("a", "f32", 10).add("b", "f64", 3).add("c", "u8", 5).add("d", "i32", 7);
  const A = new Arena(L);
  const views = [A.f32("a"), A.f64("b"), A.u8("c"), A.i32("d")];
  const ranges = views.map((v) => [v.byteOffset, v.byteOffset + v.byteLength]).sort((x, y) => x[0] - y[0]);
  for (let i = 0; i + 1 < ranges.length; i++) assert.ok(ranges[i][1] <= ranges[i + 1][0]);
  for (const v of views) { assert.equal(v.buffer, A.buffer); assert.equal(v.byteOffset % 64, 0); }
  assert.throws(() => A.f32("b"), /view "b" is f64, not f32/);
  assert.throws(() => A.f32("zz"), /no view named "zz"/);
  assert.throws(() => new ArenaLayout().add("a", "f32", 1).add("a", "f32", 1), /duplicate view "a"/);
});

test("GGUF strings decode exactly as TextDecoder does (the short-string path and its fall-backs)", async () => {
  const { ByteCursor } = await import("../dist/02_gguf_header.js");
  const dec = new TextDecoder("utf-8", { ignoreBOM: true });
  const enc = new TextEncoder();
  const cases = [
    [], enc.encode("hello"), enc.encode("Ġthe"), enc.encode("ĊĊ"), enc.encode("é€𝄞"), [0xef, 0xbb, 0xbf, 0x41],
    [0xc0, 0x80], [0xc1, 0xbf], [0x80], [0xc3], [0x41, 0xc3], [0xc3, 0x41], [0xff, 0xfe], [0xdf, 0xbf, 0xe0],
    new Array(64).fill(0x61), new Array(65).fill(0x61), [...new Array(62).fill(0x61), 0xc3, 0xa9],
    [...new Array(63).fill(0x61), 0xc3, 0xa9],
  ].map((c) => Uint8Array.from(c));
  for (const shared of [false, true]) {
    const bytes = new Uint8Array(cases.reduce((a, c) => a + 8 + c.length, 0));
    let o = 0;
    for (const c of cases) {
      new DataView(bytes.buffer).setUint32(o, c.length, true);
      bytes.set(c, o + 8);
      o += 8 + c.length;
    }
    const buf = shared ? new SharedArrayBuffer(bytes.length) : bytes.buffer;
    if (shared) new Uint8Array(buf).set(bytes);
    const cur = new ByteCursor(buf);
    for (const c of cases) assert.equal(cur.string("s"), dec.decode(c), `${shared} ${Array.from(c)}`);
  }
});

test("parseGGUF reads only the file's bytes of a longer buffer (a WebAssembly memory holding it)", { skip: NO_MODEL }, () => {
  const file = new Uint8Array(modelBuffer());
  const big = new Uint8Array(file.length + 4096);
  big.set(file);
  const g = parseGGUF(big.buffer, file.length);
  assert.equal(g.byteLength, file.length);
  assert.equal(g.tensors.size, parseGGUF(modelBuffer()).tensors.size);
  const cut = new Uint8Array(file.length + 4096);
  cut.set(file.subarray(0, file.length - 100));            // the last tensor 100 bytes short, zeros behind it
  assert.throws(() => parseGGUF(cut.buffer, file.length - 100), /truncated GGUF: tensor/);
  assert.doesNotThrow(() => parseGGUF(cut.buffer));         // (read whole, the zeros would pass for its bytes)
  assert.throws(() => parseGGUF(big.buffer, big.length + 1), RangeError);
});
