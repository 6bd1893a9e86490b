// Step 08 — the vocabulary (Python: pyengine/tokenizer/ — vocabulary tables of Tokenizer.from_gguf).
//
// A byte-level BPE vocabulary (tokenizer.ggml.model = "gpt2") spells every byte as one printable character
// (GPT-2's bytes_to_unicode: printable Latin-1 bytes stand for themselves, the other 68 bytes map to
// U+0100.. in order). So token strings are "byte strings in disguise"; tokenBytes() undoes the disguise.
// Control tokens (token_type 3, e.g. <|im_end|>) and user-defined ones (4) are matched whole in the text.

import { GGUFError } from "./02_gguf_header.js";
import { Metadata, metaNumber, metaString, metaStrings } from "./03_metadata.js";

export const TOKEN_CONTROL = 3;
export const TOKEN_USER_DEFINED = 4;

/** GPT-2 bytes_to_unicode: byte -> the character that spells it. */
export function byteToCharTable(): string[] {
  const table: string[] = new Array(256);
  let extra = 0;
  for (let b = 0; b < 256; b++) {
    const printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
    table[b] = String.fromCharCode(printable ? b : 256 + extra++);
  }
  return table;
}

export interface Vocab {
  tokens: string[];
  ids: Map<string, number>;
  mergeRank: Map<string, number>; // "left right" -> priority (lower merges first)
  special: string[]; // whole-match tokens, longest first
  byteToChar: string[];
  charToByte: Map<string, number>;
  tokenBytes: Uint8Array; // all tokens' raw bytes, concatenated
  byteStart: Int32Array; // token i's bytes are tokenBytes[byteStart[i] .. byteStart[i+1])
  bosId: number;
  eosId: number;
  stopIds: Set<number>; // eos + chat/document end markers
  chatTemplate: string;
}

export function readVocab(md: Metadata): Vocab {
  const model = metaString(md, "tokenizer.ggml.model");
  if (model !== "gpt2") throw new GGUFError(`ts-mini supports byte-level BPE (tokenizer.ggml.model "gpt2"), not "${model}"`);
  const tokens = metaStrings(md, "tokenizer.ggml.tokens");
  const merges = metaStrings(md, "tokenizer.ggml.merges");
  const typesRaw = md.get("tokenizer.ggml.token_type") as ArrayLike<number> | undefined;
  if (typesRaw && typesRaw.length !== tokens.length) {
    throw new GGUFError(`tokenizer.ggml.token_type has ${typesRaw.length} entries for ${tokens.length} tokens`);
  }

  const ids = new Map<string, number>();
  tokens.forEach((t, i) => { if (!ids.has(t)) ids.set(t, i); });
  const mergeRank = new Map<string, number>();
  merges.forEach((m, i) => { if (!mergeRank.has(m)) mergeRank.set(m, i); });

  const byteToChar = byteToCharTable();
  const charToByte = new Map<string, number>(byteToChar.map((c, b) => [c, b]));

  const special: string[] = [];
  const utf8 = new TextEncoder();
  const parts: Uint8Array[] = [];
  const byteStart = new Int32Array(tokens.length + 1);
  let total = 0;
  for (let i = 0; i < tokens.length; i++) {
    const type = typesRaw ? typesRaw[i] : 1;
    const t = tokens[i];
    let bytes: Uint8Array;
    if (type === TOKEN_CONTROL || type === TOKEN_USER_DEFINED) {
      special.push(t);
      bytes = utf8.encode(t);
    } else {
      bytes = new Uint8Array(t.length);
      let ok = true;
      for (let k = 0; k < t.length; k++) {
        const b = charToByte.get(t[k]);
        if (b === undefined) { ok = false; break; }
        bytes[k] = b;
      }
      if (!ok) bytes = utf8.encode(t); // not byte-spelled: take its text
    }
    parts.push(bytes);
    byteStart[i] = total;
    total += bytes.length;
  }
  byteStart[tokens.length] = total;
  const tokenBytes = new Uint8Array(total);
  parts.forEach((p, i) => tokenBytes.set(p, byteStart[i]));
  special.sort((a, b) => b.length - a.length);

  const bosId = metaNumber(md, "tokenizer.ggml.bos_token_id", -1);
  const eosId = metaNumber(md, "tokenizer.ggml.eos_token_id", -1);
  const stopIds = new Set<number>();
  if (eosId >= 0) stopIds.add(eosId);
  for (const name of ["<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<end_of_turn>"]) {
    const id = ids.get(name);
    if (id !== undefined) stopIds.add(id);
  }
  const chatTemplate = metaString(md, "tokenizer.chat_template", "");
  return { tokens, ids, mergeRank, special, byteToChar, charToByte, tokenBytes, byteStart, bosId, eosId, stopIds,
    chatTemplate };
}

export function tokenBytes(v: Vocab, id: number): Uint8Array {
  if (!Number.isInteger(id) || id < 0 || id >= v.tokens.length) throw new RangeError(`token id ${id} out of range 0..${v.tokens.length - 1}`);
  return v.tokenBytes.subarray(v.byteStart[id], v.byteStart[id + 1]);
}
