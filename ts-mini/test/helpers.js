// Shared by the test files: where the model and the golden files are, loaded once per test process.
import { existsSync, readFileSync } from "node:fs";
import { loadModel } from "../dist/index.js";
import { defaultModelPath, readArrayBuffer } from "../dist/model_path.js";

export const REPO = new URL("../../", import.meta.url).pathname;
export const MODEL_PATH = defaultModelPath();
export const HAVE_MODEL = existsSync(MODEL_PATH);
export const NO_MODEL = HAVE_MODEL ? false : `model not found at ${MODEL_PATH} (set PYENGINE_MODEL)`;

export function readJSON(path) {
  return JSON.parse(readFileSync(path, "utf8"));
}
export const golden = (name) => readJSON(`${REPO}tests/golden/${name}`);
export const fixture = (name) => readJSON(new URL(`./fixtures/${name}`, import.meta.url).pathname);

let buffer = null;
let engine = null;
export function modelBuffer() {
  buffer ??= readArrayBuffer(MODEL_PATH);
  return buffer;
}
export function engineOnce() {
  engine ??= loadModel(modelBuffer());
  return engine;
}

/** A tiny GGUF writer for crafting (in)valid files in tests. */
export class GGUFBuilder {
  constructor() { this.parts = []; }
  u8(v) { this.parts.push(Uint8Array.of(v)); return this; }
  u32(v) { const b = new Uint8Array(4); new DataView(b.buffer).setUint32(0, v, true); this.parts.push(b); return this; }
  i32(v) { const b = new Uint8Array(4); new DataView(b.buffer).setInt32(0, v, true); this.parts.push(b); return this; }
  f32(v) { const b = new Uint8Array(4); new DataView(b.buffer).setFloat32(0, v, true); this.parts.push(b); return this; }
  u64(v) { const b = new Uint8Array(8); new DataView(b.buffer).setBigUint64(0, BigInt(v), true); this.parts.push(b); return this; }
  str(s) { const b = new TextEncoder().encode(s); this.u64(b.length); this.parts.push(b); return this; }
  bytes(b) { this.parts.push(b); return this; }
  pad(alignment) { const n = this.length % alignment; if (n) this.parts.push(new Uint8Array(alignment - n)); return this; }
  get length() { return this.parts.reduce((a, p) => a + p.length, 0); }
  build() {
    const out = new Uint8Array(this.length);
    let o = 0;
    for (const p of this.parts) { out.set(p, o); o += p.length; }
    return out.buffer;
  }
}
