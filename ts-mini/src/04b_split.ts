// Step 04b — split GGUF files (Python: pyengine/gguf/split.py and GGUFFile's part joining in reader.py).
//
// llama.cpp's gguf-split writes a model as N complete GGUF files `<prefix>-00001-of-0000N.gguf` ...; each has
// `split.no` (0-based), `split.count` (N) and `split.tensors.count` (all tensors), the first part also carries
// all the metadata, and each part's tensor table lists only its own tensors. ts-mini reads weights from ONE
// buffer, so joinSplit writes the parts as one ordinary GGUF: part 1's header and metadata (tensor count
// patched, split.count set to 1 so no reader looks for parts again), every part's tensor infos with new
// offsets, then the tensor data. A missing, extra, mismatched or duplicate part is refused by its number.

import { ByteCursor, GGUFError, readHeader } from "./02_gguf_header.js";
import { metaNumber, readMetadata } from "./03_metadata.js";
import { GGUFFile, isBuffer, parseGGUF } from "./04_tensor_table.js";

export const SPLIT_NAME = /^(.*)-(\d{5})-of-(\d{5})\.gguf$/;

/** The file names of all parts, given the first part's name (null if it is not a first part). */
export function splitPartNames(first: string): string[] | null {
  const m = SPLIT_NAME.exec(first);
  if (!m || Number(m[2]) !== 1) return null;
  const n = Number(m[3]);
  return Array.from({ length: n }, (_, i) => `${m[1]}-${String(i + 1).padStart(5, "0")}-of-${m[3]}.gguf`);
}

/** Split keys of a parsed part: [no, count], or null for an ordinary file. */
export function splitInfo(g: GGUFFile): [number, number] | null {
  if (!g.metadata.has("split.count")) return null;
  return [metaNumber(g.metadata, "split.no", 0), metaNumber(g.metadata, "split.count")];
}

/** Byte offset and GGUF value type of top-level key `key` in the metadata of the file in `buffer`. */
function valueAt(buffer: ArrayBufferLike, key: string): [number, number] {
  const cur = new ByteCursor(buffer);
  const { kvCount } = readHeader(cur);
  for (let i = 0; i < kvCount; i++) {
    const at = cur.pos;
    if (cur.string(`metadata key #${i}`) === key) return [cur.pos + 4, cur.u32(`type of ${key}`)];
    cur.pos = at;
    readMetadata(cur, 1); // skip this key and its value
  }
  throw new GGUFError(`metadata key "${key}" not found`);
}

/** One GGUF buffer holding all parts of a split model (parts in order; an ordinary file comes back as is). */
export function joinSplit(parts: ArrayBufferLike[]): ArrayBufferLike {
  if (!Array.isArray(parts) || parts.length === 0 || !parts.every(isBuffer)) throw new GGUFError("joinSplit expects an array of ArrayBuffers");
  const files = parts.map((p, i) => {
    try {
      return parseGGUF(p);
    } catch (e) {
      throw new GGUFError(`split GGUF part ${i + 1} of ${parts.length}: ${(e as Error).message}`);
    }
  });
  const first = splitInfo(files[0]);
  if (first === null || first[1] === 1) {
    if (parts.length > 1) throw new GGUFError(`the first file is not split, but ${parts.length} files were given`);
    return parts[0];
  }
  const count = first[1];
  if (first[0] !== 0) throw new GGUFError(`the first file given is part ${first[0] + 1} of ${count}: start with part 1`);
  if (parts.length !== count) throw new GGUFError(`split GGUF has ${count} parts, ${parts.length} given (part ${parts.length < count ? parts.length + 1 : count + 1} ${parts.length < count ? "is missing" : "is extra"})`);
  const names = new Set<string>();
  files.forEach((g, i) => {
    const s = splitInfo(g);
    if (!s || s[0] !== i || s[1] !== count) {
      throw new GGUFError(`split GGUF part ${i + 1} of ${count} does not belong here: it says ${s ? `part ${s[0] + 1} of ${s[1]}` : "it is not split"}`);
    }
    for (const name of g.tensors.keys()) {
      if (names.has(name)) throw new GGUFError(`split GGUF part ${i + 1}: tensor "${name}" is also in an earlier part`);
      names.add(name);
    }
  });
  const want = metaNumber(files[0].metadata, "split.tensors.count", names.size);
  if (want !== names.size) throw new GGUFError(`split.tensors.count is ${want} but the ${count} parts hold ${names.size} tensors`);

  // header + metadata of part 1, as bytes
  const cur = new ByteCursor(parts[0]);
  const { kvCount } = readHeader(cur);
  readMetadata(cur, kvCount);
  const metaEnd = cur.pos, align = files[0].alignment;
  const enc = new TextEncoder();
  const infos: Uint8Array[] = [];
  let dataSize = 0;
  const placed: { src: Uint8Array; rel: number }[] = [];
  for (const g of files) {
    for (const t of g.tensors.values()) {
      const name = enc.encode(t.name), nd = t.shape.length;
      const b = new Uint8Array(8 + name.length + 4 + 8 * nd + 4 + 8), v = new DataView(b.buffer);
      v.setBigUint64(0, BigInt(name.length), true);
      b.set(name, 8);
      let o = 8 + name.length;
      v.setUint32(o, nd, true); o += 4;
      for (let d = nd - 1; d >= 0; d--, o += 8) v.setBigUint64(o, BigInt(t.shape[d]), true); // ne: reversed shape
      v.setUint32(o, t.type, true); o += 4;
      v.setBigUint64(o, BigInt(dataSize), true);
      infos.push(b);
      placed.push({ src: new Uint8Array(g.buffer, t.offset, t.nbytes), rel: dataSize });
      dataSize += Math.ceil(t.nbytes / align) * align;
    }
  }
  const infoBytes = infos.reduce((a, b) => a + b.length, 0);
  const dataStart = Math.ceil((metaEnd + infoBytes) / align) * align;
  const out = new Uint8Array(dataStart + dataSize);
  out.set(new Uint8Array(parts[0], 0, metaEnd), 0);
  const view = new DataView(out.buffer);
  view.setBigUint64(8, BigInt(names.size), true); // tensor_count: all parts
  const [at, type] = valueAt(parts[0], "split.count"); // now one file
  if (type === 2 || type === 3) view.setUint16(at, 1, true);
  else if (type === 4 || type === 5) view.setUint32(at, 1, true);
  else throw new GGUFError(`split.count has GGUF value type ${type}, expected an integer`);
  let o = metaEnd;
  for (const b of infos) { out.set(b, o); o += b.length; }
  for (const { src, rel } of placed) out.set(src, dataStart + rel);
  return out.buffer;
}
