// Step 03 — metadata key/value pairs (Python: pyengine/gguf/reader.py, GGUFFile.metadata).
//
// Each pair is: string key | u32 value type | value. Arrays are: u32 element type | u64 count | elements.
// Numeric arrays come back as typed arrays (one copy, no per-element objects); string arrays as string[].

import { ByteCursor, GGUFError } from "./02_gguf_header.js";

export type MetaValue = number | boolean | string | MetaValue[] | string[] | ArrayLike<number>;
export type Metadata = Map<string, MetaValue>;

// GGUF value type ids.
const U8 = 0, I8 = 1, U16 = 2, I16 = 3, U32 = 4, I32 = 5, F32 = 6, BOOL = 7, STRING = 8, ARRAY = 9, U64 = 10,
  I64 = 11, F64 = 12;
const SCALAR_BYTES: Record<number, number> = { [U8]: 1, [I8]: 1, [U16]: 2, [I16]: 2, [U32]: 4, [I32]: 4, [F32]: 4,
  [BOOL]: 1, [U64]: 8, [I64]: 8, [F64]: 8 };

function readScalar(cur: ByteCursor, type: number, what: string): number | boolean | string {
  switch (type) {
    case U8: return cur.u8(what);
    case I8: return cur.i8(what);
    case U16: return cur.u16(what);
    case I16: return cur.i16(what);
    case U32: return cur.u32(what);
    case I32: return cur.i32(what);
    case F32: return cur.f32(what);
    case BOOL: {
      const b = cur.u8(what);
      if (b > 1) throw new GGUFError(`corrupt GGUF: ${what} is a bool with byte value ${b}`);
      return b === 1;
    }
    case STRING: return cur.string(what);
    case U64: return cur.u64(what);
    case I64: return cur.i64(what);
    case F64: return cur.f64(what);
    default: throw new GGUFError(`corrupt GGUF: ${what} has unknown value type ${type}`);
  }
}

function readArray(cur: ByteCursor, what: string): MetaValue {
  const type = cur.u32(`element type of ${what}`);
  const n = cur.u64(`length of ${what}`);
  const each = SCALAR_BYTES[type];
  if (each !== undefined && n * each > cur.length - cur.pos) {
    throw new GGUFError(`truncated GGUF: array ${what} claims ${n} elements, not enough bytes left`);
  }
  if (type === STRING) {
    if (n * 8 > cur.length - cur.pos) throw new GGUFError(`truncated GGUF: array ${what} claims ${n} strings`);
    const out: string[] = new Array(n);
    for (let i = 0; i < n; i++) out[i] = cur.string(what, i);
    return out;
  }
  if (type === ARRAY) {
    const out: MetaValue[] = [];
    for (let i = 0; i < n; i++) out.push(readArray(cur, `${what}[${i}]`));
    return out;
  }
  if (each === undefined) throw new GGUFError(`corrupt GGUF: array ${what} has unknown element type ${type}`);
  // Numbers: one typed array (bools become 0/1). Small integer types fit Int32Array; the rest Float64Array.
  const out = type === U8 || type === BOOL ? new Uint8Array(n)
    : type === I8 || type === I16 || type === U16 || type === I32 ? new Int32Array(n) : new Float64Array(n);
  for (let i = 0; i < n; i++) out[i] = Number(readScalar(cur, type, what));
  return out;
}

export function readMetadata(cur: ByteCursor, kvCount: number): Metadata {
  const md: Metadata = new Map();
  for (let i = 0; i < kvCount; i++) {
    const key = cur.string(`key #${i}`);
    const type = cur.u32(`value type of "${key}"`);
    const value = type === ARRAY ? readArray(cur, `"${key}"`) : readScalar(cur, type, `"${key}"`);
    md.set(key, value);
  }
  return md;
}

/** Typed getters that name the key when it is missing or of the wrong kind. */
export function metaNumber(md: Metadata, key: string, fallback?: number): number {
  const v = md.get(key);
  if (v === undefined) {
    if (fallback !== undefined) return fallback;
    throw new GGUFError(`GGUF metadata is missing "${key}"`);
  }
  if (typeof v !== "number") throw new GGUFError(`GGUF metadata "${key}" is not a number`);
  return v;
}

export function metaString(md: Metadata, key: string, fallback?: string): string {
  const v = md.get(key);
  if (v === undefined) {
    if (fallback !== undefined) return fallback;
    throw new GGUFError(`GGUF metadata is missing "${key}"`);
  }
  if (typeof v !== "string") throw new GGUFError(`GGUF metadata "${key}" is not a string`);
  return v;
}

export function metaStrings(md: Metadata, key: string): string[] {
  const v = md.get(key);
  if (!Array.isArray(v) || (v.length > 0 && typeof v[0] !== "string")) {
    throw new GGUFError(`GGUF metadata "${key}" is missing or not a string array`);
  }
  return v as string[];
}
