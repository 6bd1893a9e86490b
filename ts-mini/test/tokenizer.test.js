// Tokenizer: ids, pre-tokenizer pieces and decoded text against HF transformers' golden files (tests/golden/).
import { test } from "node:test";
import assert from "node:assert/strict";
import { pretokenize } from "../dist/09_bpe_encode.js";
import { Utf8Stream } from "../dist/10_utf8_stream.js";
import { NO_MODEL, engineOnce, golden } from "./helpers.js";

const TOK = golden("tokenizer_smollm2.json");

test("encode matches HF on every golden text (add_special_tokens=False, special tokens parsed)", { skip: NO_MODEL }, () => {
  const e = engineOnce();
  assert.ok(TOK.cases.length >= 50);
  for (const c of [...TOK.cases, ...(TOK.lossy_cases ?? [])]) assert.deepEqual(e.encode(c.text), c.ids, JSON.stringify(c.text));
});

test("special-token parsing on/off matches HF", { skip: NO_MODEL }, () => {
  const e = engineOnce();
  for (const c of TOK.special_cases) {
    if (c.add_special_tokens) continue; // SmolLM2 adds no BOS/EOS either way; our encode never adds them
    assert.deepEqual(e.encode(c.text, c.parse_special), c.ids, `${JSON.stringify(c.text)} parse_special=${c.parse_special}`);
  }
});

test("decode matches HF, with and without special tokens (invalid UTF-8 becomes U+FFFD)", { skip: NO_MODEL }, () => {
  const e = engineOnce();
  for (const c of TOK.decode_cases) {
    assert.equal(e.decode(c.ids), c.text, JSON.stringify(c.ids));
    assert.equal(e.decode(c.ids, true), c.text_skip_special, JSON.stringify(c.ids));
  }
  for (const c of TOK.lossy_cases ?? []) assert.equal(e.decode(c.ids), c.decoded);
});

test("pre-tokenizer pieces match HF's smollm pre-tokenizer (digits isolated, GPT-2 regex)", () => {
  const P = golden("tokenizer_pretokenize.json");
  for (const c of P.cases) assert.deepEqual(pretokenize(c.text), c.pieces.smollm, JSON.stringify(c.text));
});

test("the generation golden's prompt_ids are reproduced from the prompt text", { skip: NO_MODEL }, () => {
  const e = engineOnce();
  for (const c of golden("generation_smollm2.json").cases) assert.deepEqual(e.encode(c.prompt), c.prompt_ids, JSON.stringify(c.prompt));
});

test("streaming decode never emits half a character and adds up to the full decode", { skip: NO_MODEL }, () => {
  const e = engineOnce();
  const texts = [...TOK.cases.map((c) => c.text), "é😀中文🇺🇸 ok"];
  for (const text of texts) {
    const ids = e.encode(text);
    const s = new Utf8Stream();
    let out = "";
    for (const id of ids) {
      const piece = s.add(e.tokenBytes(id));
      // a lone high surrogate at the end would mean a split character
      assert.ok(!/[\uD800-\uDBFF]$/.test(piece), "split surrogate pair");
      if (!text.includes("\uFFFD")) assert.ok(!piece.includes("\uFFFD"), `replacement char streamed for ${JSON.stringify(text)}`);
      out += piece;
    }
    out += s.flush();
    assert.equal(out, new TextDecoder("utf-8", { ignoreBOM: true }).decode(concat(ids.map((id) => e.tokenBytes(id)))));
  }
});

test("Utf8Stream holds back incomplete sequences byte by byte, and flushes leftovers as U+FFFD", () => {
  const bytes = new TextEncoder().encode("aé€😀z");
  const s = new Utf8Stream();
  const pieces = [...bytes].map((b) => s.add(Uint8Array.of(b)));
  assert.deepEqual(pieces, ["a", "", "é", "", "", "€", "", "", "", "😀", "z"]);
  assert.equal(s.add(Uint8Array.of(0xf0, 0x9f)), "");
  assert.equal(s.flush(), "\uFFFD");
  assert.equal(s.add(Uint8Array.of(0x80, 0x41)), "\uFFFDA"); // stray continuation byte is not held
});

test("chat template reproduces the golden chat prompt's ids", { skip: NO_MODEL }, () => {
  const e = engineOnce();
  const c = golden("generation_smollm2.json").cases.find((c) => c.prompt.startsWith("<|im_start|>system"));
  const user = /<\|im_start\|>user\n([\s\S]*?)<\|im_end\|>/.exec(c.prompt)[1];
  const text = e.applyChatTemplate([{ role: "user", content: user }]);
  assert.equal(text, c.prompt);
  assert.deepEqual(e.promptIds(user, true), c.prompt_ids);
});

function concat(parts) {
  const out = new Uint8Array(parts.reduce((a, p) => a + p.length, 0));
  let o = 0;
  for (const p of parts) { out.set(p, o); o += p.length; }
  return out;
}
