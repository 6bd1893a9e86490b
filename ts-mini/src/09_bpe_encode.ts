// Step 09 — byte-level BPE encoding (Python: pyengine/tokenizer/ — pre-tokenizer + BPE merges + chat template).
//
// encode(text):
//   1. cut out special tokens (<|im_start|> ...) — they map straight to their ids;
//   2. pre-tokenize the rest the way SmolLM2's tokenizer.json does ("smollm" in the GGUF):
//      a. Digits(individual_digits): every numeric character (\p{N}) becomes a piece of its own;
//      b. ByteLevel's GPT-2 regex on each remaining run: contractions, ` ?letters`, ` ?digits`, ` ?other`,
//         whitespace runs (a run before a word leaves its last space to that word);
//   3. spell each piece's UTF-8 bytes with the byte alphabet and merge pairs by rank until no merge applies.
// HF's regex engine treats \s as Unicode White_Space; JS's \s also includes U+FEFF and misses U+0085, so the
// class is spelled out. A byte whose character is missing from the vocabulary is dropped, as HF's BPE (with
// no unk token) does — SmolLM2 lacks a few control bytes (e.g. 0x1D).

import type { Vocab } from "./08_vocab.js";

const WS = "\\t\\n\\v\\f\\r \\u0085\\u00a0\\u1680\\u2000-\\u200a\\u2028\\u2029\\u202f\\u205f\\u3000";
export const PRETOKENIZE = new RegExp(
  `'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^${WS}\\p{L}\\p{N}]+|[${WS}]+(?![^${WS}])|[${WS}]+`, "gu");

const DIGIT = /\p{N}/u;
const NUMERIC_OR_RUN = /\p{N}|[^\p{N}]+/gu;

export function pretokenize(text: string): string[] {
  const pieces: string[] = [];
  for (const part of text.match(NUMERIC_OR_RUN) ?? []) {
    if (DIGIT.test(part)) pieces.push(part);
    else for (const p of part.match(PRETOKENIZE) ?? []) pieces.push(p);
  }
  return pieces;
}

function escapeRegex(s: string): string {
  return s.replace(/[.*+?^${}()|[\]\\]/g, "\\$&");
}

export class BPEEncoder {
  private readonly v: Vocab;
  private readonly specialRe: RegExp | null;
  private readonly cache = new Map<string, number[]>();
  private readonly utf8 = new TextEncoder();

  constructor(v: Vocab) {
    this.v = v;
    // Longest first, so "<|im_start|>" wins over any shorter special that is its prefix.
    this.specialRe = v.special.length ? new RegExp(v.special.map(escapeRegex).join("|"), "g") : null;
  }

  encode(text: string, parseSpecial = true): number[] {
    const out: number[] = [];
    if (!parseSpecial || !this.specialRe) {
      this.encodeOrdinary(text, out);
      return out;
    }
    let last = 0;
    for (const m of text.matchAll(this.specialRe)) {
      this.encodeOrdinary(text.slice(last, m.index), out);
      out.push(this.v.ids.get(m[0])!);
      last = m.index! + m[0].length;
    }
    this.encodeOrdinary(text.slice(last), out);
    return out;
  }

  private encodeOrdinary(text: string, out: number[]): void {
    if (!text) return;
    for (const piece of pretokenize(text)) {
      let ids = this.cache.get(piece);
      if (!ids) {
        ids = this.bpe(piece);
        if (this.cache.size < 50000) this.cache.set(piece, ids);
      }
      for (const id of ids) out.push(id);
    }
  }

  /** Merge the piece's byte characters pair by pair, always taking the lowest-ranked merge first. */
  bpe(piece: string): number[] {
    const bytes = this.utf8.encode(piece);
    let symbols: string[] = Array.from(bytes, (b) => this.v.byteToChar[b]);
    const rank = this.v.mergeRank;
    while (symbols.length > 1) {
      let best = Infinity, bestAt = -1;
      for (let i = 0; i + 1 < symbols.length; i++) {
        const r = rank.get(symbols[i] + " " + symbols[i + 1]);
        if (r !== undefined && r < best) { best = r; bestAt = i; }
      }
      if (bestAt < 0) break;
      const a = symbols[bestAt], b = symbols[bestAt + 1];
      const merged: string[] = [];
      for (let i = 0; i < symbols.length; i++) {
        if (i + 1 < symbols.length && symbols[i] === a && symbols[i + 1] === b) {
          merged.push(a + b);
          i++;
        } else merged.push(symbols[i]);
      }
      symbols = merged;
    }
    const ids: number[] = [];
    for (const s of symbols) {
      const id = this.v.ids.get(s);
      if (id !== undefined) ids.push(id);
      else for (const ch of s) { const b = this.v.ids.get(ch); if (b !== undefined) ids.push(b); } // else dropped
    }
    return ids;
  }
}

export interface ChatMessage {
  role: string;
  content: string;
}

/**
 * ChatML, as SmolLM2's template writes it: an implicit system turn (text taken from the GGUF's own template)
 * when the first message is not a system message, then `<|im_start|>role\ncontent<|im_end|>\n` per message.
 */
export function applyChatTemplate(v: Vocab, messages: ChatMessage[], addGenerationPrompt = true): string {
  if (!v.ids.has("<|im_start|>")) throw new Error("this vocabulary has no <|im_start|>: ChatML chat template unavailable");
  let out = "";
  // The template hard-codes its default system prompt; read it from there rather than from this file.
  const m = /<\|im_start\|>system(?:\n|\\n)([^<']*)<\|im_end\|>/.exec(v.chatTemplate);
  const defaultSystem = m ? m[1].replace(/\\n/g, "\n") : null;
  if (defaultSystem !== null && (messages.length === 0 || messages[0].role !== "system")) {
    out += `<|im_start|>system\n${defaultSystem}<|im_end|>\n`;
  }
  for (const msg of messages) out += `<|im_start|>${msg.role}\n${msg.content}<|im_end|>\n`;
  if (addGenerationPrompt) out += "<|im_start|>assistant\n";
  return out;
}
