// Step 05 — half floats and weight views (Python: pyengine/gguf/quants.py, F16/BF16/F32 cases of dequantize).
//
// Quantized blocks carry their scales as IEEE half floats (f16). Converting one costs a few branches, so we
// fill a 65536-entry table once (it lives in the arena) and every kernel does `half[bits]`.
// WeightViews are typed-array windows over the *whole* GGUF buffer: kernels index them with byte offsets
// divided by the element size, so weights are read in place and never copied.

export function halfToFloat(h: number): number {
  const sign = h & 0x8000 ? -1 : 1;
  const exp = (h >>> 10) & 0x1f;
  const frac = h & 0x3ff;
  if (exp === 0) return sign * frac * 2 ** -24; // subnormal (and ±0)
  if (exp === 31) return frac ? NaN : sign * Infinity;
  return sign * (1 + frac / 1024) * 2 ** (exp - 15);
}

let halfTable: Float32Array | null = null; // computed once, copied into each arena (a load fills two tables)

export function fillHalfTable(table: Float32Array): Float32Array {
  if (table.length !== 65536) throw new Error("half table must have 65536 entries");
  if (!halfTable) {
    halfTable = new Float32Array(65536);
    for (let h = 0; h < 65536; h++) halfTable[h] = halfToFloat(h);
  }
  table.set(halfTable);
  return table;
}

/** bf16 is the top half of an f32: shift into place and reinterpret. */
const bfScratch = new Uint32Array(1);
const bfAsFloat = new Float32Array(bfScratch.buffer);
export function bf16ToFloat(b: number): number {
  bfScratch[0] = (b & 0xffff) << 16;
  return bfAsFloat[0];
}

export interface WeightViews {
  u8: Uint8Array;
  i8: Int8Array;
  i16: Int16Array;
  u16: Uint16Array;
  u32: Uint32Array;
  i32: Int32Array; // the same words signed: bit fields stay int32 in the JIT (u32 words >= 2^31 become doubles)
  f32: Float32Array;
  half: Float32Array; // f16 bits -> value
}

export function makeWeightViews(buffer: ArrayBufferLike, half: Float32Array): WeightViews {
  // Kernels read u16/u32 words in the machine's byte order; GGUF is little-endian.
  if (new Uint8Array(new Uint16Array([1]).buffer)[0] !== 1) throw new Error("ts-mini needs a little-endian machine");
  const n = buffer.byteLength;
  return {
    u8: new Uint8Array(buffer),
    i8: new Int8Array(buffer),
    i16: new Int16Array(buffer, 0, n >>> 1),
    u16: new Uint16Array(buffer, 0, n >>> 1),
    u32: new Uint32Array(buffer, 0, n >>> 2),
    i32: new Int32Array(buffer, 0, n >>> 2),
    f32: new Float32Array(buffer, 0, n >>> 2),
    half,
  };
}

// Row kernels for the unquantized types. `off` is the row's byte offset, `n` its length.

export function dotF32(w: WeightViews, off: number, x: Float64Array, n: number): number {
  const f = w.f32, base = off >>> 2;
  let s = 0;
  for (let i = 0; i < n; i++) s += f[base + i] * x[i];
  return s;
}
export function dotF16(w: WeightViews, off: number, x: Float64Array, n: number): number {
  const u = w.u16, h = w.half, base = off >>> 1;
  let s = 0;
  for (let i = 0; i < n; i++) s += h[u[base + i]] * x[i];
  return s;
}
export function dotBF16(w: WeightViews, off: number, x: Float64Array, n: number): number {
  const u = w.u16, base = off >>> 1;
  let s = 0;
  for (let i = 0; i < n; i++) s += bf16ToFloat(u[base + i]) * x[i];
  return s;
}

export function dequantF32(w: WeightViews, off: number, n: number, out: Float32Array, o: number): void {
  out.set(w.f32.subarray(off >>> 2, (off >>> 2) + n), o);
}
export function dequantF16(w: WeightViews, off: number, n: number, out: Float32Array, o: number): void {
  const u = w.u16, h = w.half, base = off >>> 1;
  for (let i = 0; i < n; i++) out[o + i] = h[u[base + i]];
}
export function dequantBF16(w: WeightViews, off: number, n: number, out: Float32Array, o: number): void {
  const u = w.u16, base = off >>> 1;
  for (let i = 0; i < n; i++) out[o + i] = bf16ToFloat(u[base + i]);
}
