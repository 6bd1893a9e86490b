// Step 04 — the tensor table (Python: pyengine/gguf/reader.py TensorInfo + pyengine/gguf/quants.py GGML_BLOCK).
//
// After the metadata: for each tensor, string name | u32 n_dims | u64 ne[n_dims] | u32 ggml type | u64 offset.
// Tensor data starts at the next multiple of general.alignment (default 32); offsets are relative to it.
// GGUF lists ne fastest-varying first; `shape` here is reversed (NumPy order), so a weight [out, in] has
// ne = (in, out) and each of its `out` rows is `in` consecutive elements = in/blockSize consecutive blocks.

import { ByteCursor, GGUFError, readHeader } from "./02_gguf_header.js";
import { Metadata, metaNumber, readMetadata } from "./03_metadata.js";

export const GGMLType = {
  F32: 0, F16: 1, Q4_0: 2, Q4_1: 3, Q5_0: 6, Q5_1: 7, Q8_0: 8, Q8_1: 9, Q2_K: 10, Q3_K: 11, Q4_K: 12, Q5_K: 13,
  Q6_K: 14, Q8_K: 15, BF16: 30,
} as const;

/** [elements per block, bytes per block] for every type whose size we know (even if we cannot compute with it). */
export const GGML_BLOCK: Record<number, [number, number]> = {
  [GGMLType.F32]: [1, 4], [GGMLType.F16]: [1, 2], [GGMLType.BF16]: [1, 2],
  [GGMLType.Q4_0]: [32, 18], [GGMLType.Q4_1]: [32, 20], [GGMLType.Q5_0]: [32, 22], [GGMLType.Q5_1]: [32, 24],
  [GGMLType.Q8_0]: [32, 34], [GGMLType.Q8_1]: [32, 36],
  [GGMLType.Q2_K]: [256, 84], [GGMLType.Q3_K]: [256, 110], [GGMLType.Q4_K]: [256, 144], [GGMLType.Q5_K]: [256, 176],
  [GGMLType.Q6_K]: [256, 210], [GGMLType.Q8_K]: [256, 292],
};

export function typeName(t: number): string {
  for (const [k, v] of Object.entries(GGMLType)) if (v === t) return k;
  return `type#${t}`;
}

export interface TensorInfo {
  name: string;
  shape: number[]; // NumPy order (reversed ne)
  type: number;
  offset: number; // absolute byte offset in the file buffer
  nbytes: number;
  rowLength: number; // ne[0]: elements per row
  rows: number; // product of the other dims
  rowBytes: number;
}

export interface GGUFFile {
  buffer: ArrayBufferLike; // an ArrayBuffer, or a SharedArrayBuffer when worker threads share the weights
  byteLength: number; // the file's size: its bytes are buffer[0 .. byteLength) (a WebAssembly memory may be longer)
  version: number;
  alignment: number;
  metadata: Metadata;
  tensors: Map<string, TensorInfo>;
}

/** An ArrayBuffer or (where the platform has one) a SharedArrayBuffer. */
export function isBuffer(b: unknown): b is ArrayBufferLike {
  return b instanceof ArrayBuffer || (typeof SharedArrayBuffer !== "undefined" && b instanceof SharedArrayBuffer);
}

export function tensor(g: GGUFFile, name: string): TensorInfo {
  const t = g.tensors.get(name);
  if (!t) throw new GGUFError(`GGUF has no tensor named "${name}"`);
  return t;
}

/** Parse header, metadata and tensor table. The tensor data is not copied: offsets point into `buffer`, whose
 * first `byteLength` bytes are the file (default: all of it). */
export function parseGGUF(buffer: ArrayBufferLike, byteLength = buffer.byteLength): GGUFFile {
  if (!isBuffer(buffer)) throw new GGUFError("parseGGUF expects an ArrayBuffer");
  if (!Number.isInteger(byteLength) || byteLength < 0 || byteLength > buffer.byteLength) {
    throw new RangeError(`parseGGUF: byteLength ${byteLength} is not within the buffer's ${buffer.byteLength} bytes`);
  }
  const cur = new ByteCursor(buffer, 0, byteLength);
  const { version, tensorCount, kvCount } = readHeader(cur);
  const metadata = readMetadata(cur, kvCount);
  const alignment = metaNumber(metadata, "general.alignment", 32);
  if (!Number.isInteger(alignment) || alignment <= 0 || alignment % 8 !== 0) {
    throw new GGUFError(`corrupt GGUF: general.alignment ${alignment} must be a positive multiple of 8`);
  }

  const raw: { name: string; ne: number[]; type: number; rel: number }[] = [];
  for (let i = 0; i < tensorCount; i++) {
    const name = cur.string(`name of tensor #${i}`);
    const nDims = cur.u32(`n_dims of tensor "${name}"`);
    if (nDims < 1 || nDims > 4) throw new GGUFError(`corrupt GGUF: tensor "${name}" has ${nDims} dimensions (1..4 allowed)`);
    const ne: number[] = [];
    for (let d = 0; d < nDims; d++) ne.push(cur.u64(`ne[${d}] of tensor "${name}"`));
    const type = cur.u32(`type of tensor "${name}"`);
    const rel = cur.u64(`offset of tensor "${name}"`);
    raw.push({ name, ne, type, rel });
  }
  const dataStart = Math.ceil(cur.pos / alignment) * alignment;

  const tensors = new Map<string, TensorInfo>();
  for (const { name, ne, type, rel } of raw) {
    const block = GGML_BLOCK[type];
    if (!block) throw new GGUFError(`tensor "${name}" has unknown ggml type ${type}`);
    const [bs, bb] = block;
    const rowLength = ne[0];
    if (rowLength % bs !== 0) throw new GGUFError(`tensor "${name}": row length ${rowLength} is not a multiple of ${typeName(type)} block size ${bs}`);
    const rows = ne.slice(1).reduce((a, b) => a * b, 1);
    const rowBytes = (rowLength / bs) * bb;
    const nbytes = rowBytes * rows;
    const offset = dataStart + rel;
    if (rel % alignment !== 0) throw new GGUFError(`corrupt GGUF: tensor "${name}" offset ${rel} is not aligned to ${alignment}`);
    if (offset + nbytes > byteLength) {
      throw new GGUFError(`truncated GGUF: tensor "${name}" needs bytes ${offset}..${offset + nbytes}, file has ${byteLength}`);
    }
    if (tensors.has(name)) throw new GGUFError(`corrupt GGUF: duplicate tensor "${name}"`);
    tensors.set(name, { name, shape: ne.slice().reverse(), type, offset, nbytes, rowLength, rows, rowBytes });
  }
  return { buffer, byteLength, version, alignment, metadata, tensors };
}
