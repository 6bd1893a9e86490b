// Step 02 — the GGUF header and a bounds-checked byte cursor (Python: pyengine/gguf/reader.py, GGUFFile.__init__).
//
// A GGUF file starts: magic "GGUF" | u32 version | u64 tensor_count | u64 kv_count, all little-endian.
// Every read goes through ByteCursor, which names what it was reading when the file ends too early, so a
// truncated or corrupt file gives a readable Error instead of a RangeError deep inside a DataView.

export class GGUFError extends Error {
  constructor(message: string) {
    super(message);
    this.name = "GGUFError";
  }
}

const utf8 = new TextDecoder("utf-8", { ignoreBOM: true }); // keep a leading U+FEFF in a token

export class ByteCursor {
  readonly view: DataView;
  readonly bytes: Uint8Array;
  readonly shared: boolean;
  pos: number;

  /** Over the first `byteLength` bytes of `buffer` (the file; a WebAssembly memory holding it is longer). */
  constructor(buffer: ArrayBufferLike, pos = 0, byteLength = buffer.byteLength) {
    this.view = new DataView(buffer, 0, byteLength);
    this.bytes = new Uint8Array(buffer, 0, byteLength);
    this.shared = typeof SharedArrayBuffer !== "undefined" && buffer instanceof SharedArrayBuffer;
    this.pos = pos;
  }

  get length(): number {
    return this.view.byteLength;
  }

  need(n: number, what: string): number {
    const at = this.pos;
    if (n < 0 || at + n > this.view.byteLength) {
      throw new GGUFError(`truncated GGUF: need ${n} bytes for ${what} at offset ${at}, file has ${this.view.byteLength}`);
    }
    this.pos = at + n;
    return at;
  }

  u8(what: string): number { return this.view.getUint8(this.need(1, what)); }
  i8(what: string): number { return this.view.getInt8(this.need(1, what)); }
  u16(what: string): number { return this.view.getUint16(this.need(2, what), true); }
  i16(what: string): number { return this.view.getInt16(this.need(2, what), true); }
  u32(what: string): number { return this.view.getUint32(this.need(4, what), true); }
  i32(what: string): number { return this.view.getInt32(this.need(4, what), true); }
  f32(what: string): number { return this.view.getFloat32(this.need(4, what), true); }
  f64(what: string): number { return this.view.getFloat64(this.need(8, what), true); }

  /** u64 as a JS number; anything beyond 2^53 cannot be a real size or offset, so it is an error. */
  u64(what: string): number {
    const v = this.view.getBigUint64(this.need(8, what), true);
    if (v > BigInt(Number.MAX_SAFE_INTEGER)) throw new GGUFError(`corrupt GGUF: ${what} = ${v} is too large`);
    return Number(v);
  }
  i64(what: string): number {
    const v = this.view.getBigInt64(this.need(8, what), true);
    if (v > BigInt(Number.MAX_SAFE_INTEGER) || v < BigInt(Number.MIN_SAFE_INTEGER)) {
      throw new GGUFError(`corrupt GGUF: ${what} = ${v} does not fit a JS number`);
    }
    return Number(v);
  }

  /** GGUF string: u64 byte length, then UTF-8 bytes (no terminator). `index` >= 0: element `index` of the
   * array `what` (its name is built only for an error: a vocabulary is ~100k strings). */
  string(what: string, index = -1): string {
    const at0 = this.pos, end = this.view.byteLength;
    let n = -1;
    if (at0 + 8 <= end && this.view.getUint32(at0 + 4, true) === 0) { // the common case, read without a BigInt
      n = this.view.getUint32(at0, true);
      if (at0 + 8 + n > end) n = -1;
    }
    let at: number;
    if (n >= 0) {
      at = at0 + 8;
      this.pos = at + n;
    } else {                                   // the checked reads, for their errors (or a >4 GiB string)
      const name = index < 0 ? what : `${what}[${index}]`;
      n = this.u64(`length of ${name}`);
      at = this.need(n, name);
    }
    if (n <= SHORT_STRING) {
      const s = shortUtf8(this.bytes, at, at + n);
      if (s !== null) return s;
    }
    // Browsers' TextDecoder refuses views of a SharedArrayBuffer (the threaded engine's weights): decode a copy.
    const b = this.shared ? this.bytes.slice(at, at + n) : this.bytes.subarray(at, at + n);
    return utf8.decode(b);
  }
}

// A vocabulary is ~100k short strings, and a TextDecoder call costs ~0.5 us in Chromium (98k tokens and merges:
// 45-55 ms, against 9-16 ms by hand; in Node 9-13 against 13-17). Strings of one- and two-byte UTF-8 sequences
// (byte-level BPE's alphabet) are decoded here; anything else (three- or four-byte sequences, invalid bytes, a
// BOM) returns null and goes to TextDecoder, so the result is always TextDecoder's.
const SHORT_STRING = 64;
const codes = new Uint16Array(SHORT_STRING);
function shortUtf8(b: Uint8Array, i: number, end: number): string | null {
  let k = 0;
  for (; i < end; i++) {
    const c = b[i];
    if (c < 0x80) codes[k++] = c;
    else if (c >= 0xc2 && c < 0xe0 && i + 1 < end && (b[i + 1] & 0xc0) === 0x80) {
      codes[k++] = ((c & 0x1f) << 6) | (b[++i] & 0x3f);
    } else return null;
  }
  // one flat string (not a chain of concatenations, which a Map key would have to flatten later)
  return String.fromCharCode.apply(null, codes.subarray(0, k) as unknown as number[]);
}

export interface GGUFHeader {
  version: number;
  tensorCount: number;
  kvCount: number;
}

const MAGIC = 0x46554747; // "GGUF" read as little-endian u32

export function readHeader(cur: ByteCursor): GGUFHeader {
  if (cur.length < 4) throw new GGUFError(`not a GGUF file: only ${cur.length} bytes`);
  const magic = cur.u32("magic");
  if (magic !== MAGIC) {
    const seen = Array.from(cur.bytes.subarray(0, 4), (b) => b.toString(16).padStart(2, "0")).join(" ");
    throw new GGUFError(`not a GGUF file: magic bytes are ${seen}, expected 47 47 55 46 ("GGUF")`);
  }
  const version = cur.u32("version");
  if (version !== 2 && version !== 3) throw new GGUFError(`unsupported GGUF version ${version} (supported: 2, 3)`);
  const tensorCount = cur.u64("tensor_count");
  const kvCount = cur.u64("kv_count");
  // Each tensor info and each key/value takes well over 8 bytes: larger counts cannot fit in the file.
  if (tensorCount * 8 > cur.length) throw new GGUFError(`corrupt GGUF: tensor_count ${tensorCount} cannot fit in ${cur.length} bytes`);
  if (kvCount * 8 > cur.length) throw new GGUFError(`corrupt GGUF: kv_count ${kvCount} cannot fit in ${cur.length} bytes`);
  return { version, tensorCount, kvCount };
}
