// Step 01 — the arena (Python: pyengine/arena.py).
//
// Every byte of runtime state (activations, KV cache, logits, sampler scratch) lives in ONE ArrayBuffer
// allocated at start. A layout is planned first (name -> kind, length), then the buffer is allocated once
// and carved into typed-array views. Nothing in the decode loop allocates, so the GC never runs mid-token.

export type ViewKind = "f32" | "f64" | "i32" | "u8";

const BYTES: Record<ViewKind, number> = { f32: 4, f64: 8, i32: 4, u8: 1 };
const ALIGN = 64; // cache-line aligned starts; also satisfies every typed array's own alignment

interface Slot {
  kind: ViewKind;
  length: number;
  offset: number;
}

export class ArenaLayout {
  readonly slots = new Map<string, Slot>();
  bytes = 0;

  add(name: string, kind: ViewKind, length: number): this {
    if (!Number.isSafeInteger(length) || length < 0) throw new Error(`arena: bad length ${length} for "${name}"`);
    if (this.slots.has(name)) throw new Error(`arena: duplicate view "${name}"`);
    const offset = Math.ceil(this.bytes / ALIGN) * ALIGN;
    this.slots.set(name, { kind, length, offset });
    this.bytes = offset + length * BYTES[kind];
    return this;
  }
}

export class Arena {
  readonly buffer: ArrayBuffer | SharedArrayBuffer;
  private readonly layout: ArenaLayout;

  /** shared: carve the views from a SharedArrayBuffer, so worker threads see the same activations (13b). */
  constructor(layout: ArenaLayout, shared = false) {
    this.layout = layout;
    const n = Math.ceil(layout.bytes / ALIGN) * ALIGN;
    this.buffer = shared ? new SharedArrayBuffer(n) : new ArrayBuffer(n);
  }

  get byteLength(): number {
    return this.buffer.byteLength;
  }

  /** The layout, in address order: each view's name, kind, byte offset and byte size (the demo's arena map). */
  regions(): { name: string; kind: ViewKind; offset: number; bytes: number }[] {
    return [...this.layout.slots].map(([name, s]) => ({ name, kind: s.kind, offset: s.offset, bytes: s.length * BYTES[s.kind] }));
  }

  private slot(name: string, kind: ViewKind): Slot {
    const s = this.layout.slots.get(name);
    if (!s) throw new Error(`arena: no view named "${name}"`);
    if (s.kind !== kind) throw new Error(`arena: view "${name}" is ${s.kind}, not ${kind}`);
    return s;
  }

  f32(name: string): Float32Array {
    const s = this.slot(name, "f32");
    return new Float32Array(this.buffer, s.offset, s.length);
  }
  f64(name: string): Float64Array {
    const s = this.slot(name, "f64");
    return new Float64Array(this.buffer, s.offset, s.length);
  }
  i32(name: string): Int32Array {
    const s = this.slot(name, "i32");
    return new Int32Array(this.buffer, s.offset, s.length);
  }
  u8(name: string): Uint8Array {
    const s = this.slot(name, "u8");
    return new Uint8Array(this.buffer, s.offset, s.length);
  }
}
