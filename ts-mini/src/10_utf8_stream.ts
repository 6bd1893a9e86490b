// Step 10 — streaming detokenization (Python: pyengine/tokenizer/ IncrementalDetokenizer).
//
// A token is a run of bytes, not of characters: "é" may arrive as 0xC3 in one token and 0xA9 in the next.
// Utf8Stream keeps the bytes of an unfinished character back until the rest arrives, so the text it emits
// never contains half a character. Invalid bytes become U+FFFD, as in the reference decode.

// ignoreBOM: keep a U+FEFF that happens to start a chunk (the default would silently drop it).
const decoder = new TextDecoder("utf-8", { ignoreBOM: true });

/** Length of a UTF-8 sequence announced by lead byte b (0 if b cannot start one). */
function seqLength(b: number): number {
  if (b < 0x80) return 1;
  if (b >= 0xc2 && b <= 0xdf) return 2;
  if (b >= 0xe0 && b <= 0xef) return 3;
  if (b >= 0xf0 && b <= 0xf4) return 4;
  return 0;
}

/** Number of trailing bytes of buf[0..n) forming a character that is still incomplete (0..3). */
export function incompleteTail(buf: Uint8Array, n: number): number {
  for (let back = 1; back <= 3 && back <= n; back++) {
    const b = buf[n - back];
    if ((b & 0xc0) === 0x80) continue; // continuation byte: keep looking for the lead
    const need = seqLength(b);
    return need > back ? back : 0;
  }
  return 0;
}

export class Utf8Stream {
  private pending = new Uint8Array(4);
  private nPending = 0;
  private scratch = new Uint8Array(256);

  /** Add one token's bytes; returns the text of every character completed so far. */
  add(bytes: Uint8Array): string {
    const n = this.nPending + bytes.length;
    if (this.scratch.length < n) this.scratch = new Uint8Array(2 * n);
    const buf = this.scratch;
    buf.set(this.pending.subarray(0, this.nPending), 0);
    buf.set(bytes, this.nPending);
    const keep = incompleteTail(buf, n);
    this.pending.set(buf.subarray(n - keep, n), 0);
    this.nPending = keep;
    return n - keep > 0 ? decoder.decode(buf.subarray(0, n - keep)) : "";
  }

  /** End of stream: whatever is held back is an incomplete character, decoded as U+FFFD. */
  flush(): string {
    const s = this.nPending ? decoder.decode(this.pending.subarray(0, this.nPending)) : "";
    this.nPending = 0;
    return s;
  }
}
