// Greedy generation and logits against HF transformers (tests/golden/generation_smollm2.json: the GGUF dequantized
// to float32 and run by transformers).
import { test } from "node:test";
import assert from "node:assert/strict";
import { loadModel } from "../dist/index.js";
import { NO_MODEL, engineOnce, golden, modelBuffer } from "./helpers.js";

const GEN = golden("generation_smollm2.json");
const N = 32; // greedy tokens compared per prompt
const PICK = ["The capital of France is", "def fibonacci", "<|im_start|>system", "Shopping list"];
const cases = PICK.map((p) => GEN.cases.find((c) => c.prompt.startsWith(p)));

/** Compare up to N tokens, but not past a step where HF's top-2 logits were within float noise of each other. */
function comparable(c) {
  const tiny = (c.tiny_margin_steps ?? []).filter((s) => s < N);
  return tiny.length ? Math.min(...tiny) + 1 : N;
}

for (const c of cases) {
  test(`greedy ids from prompt_ids equal HF: ${JSON.stringify(c.prompt.slice(0, 40))}`, { skip: NO_MODEL }, () => {
    const e = engineOnce();
    const n = comparable(c);
    const r = e.generate(c.prompt_ids, { maxTokens: n, temperature: 0, ignoreEos: true });
    assert.deepEqual(r.tokenIds, c.greedy_ids.slice(0, n));
    assert.equal(r.finishReason, "length");
    assert.equal(r.text, e.decode(r.tokenIds, true));
  });
}

test("greedy from prompt text (encoder + model) equals HF for the first prompt", { skip: NO_MODEL }, () => {
  const e = engineOnce();
  const c = cases[0];
  const r = e.generate(c.prompt, { maxTokens: 12, ignoreEos: true });
  assert.equal(r.promptTokens, c.prompt_ids.length);
  assert.deepEqual(r.tokenIds, c.greedy_ids.slice(0, 12));
});

function logSoftmax(logits) {
  let max = -Infinity;
  for (const v of logits) if (v > max) max = v;
  let s = 0;
  for (const v of logits) s += Math.exp(v - max);
  const lse = max + Math.log(s);
  return (id) => logits[id] - lse;
}

test("top-20 log-probabilities match HF at golden positions (prefill path, chunked)", { skip: NO_MODEL }, () => {
  const e = engineOnce();
  let worst = 0, checked = 0;
  for (const c of [cases[0], cases[3]]) {
    const seq = [...c.prompt_ids, ...c.greedy_ids];
    for (const t of c.top_logprobs) {
      if (t.position > 40) continue; // keep the test short
      const logits = e.model.prefill(seq.slice(0, t.position + 1));
      const lp = logSoftmax(logits);
      assert.equal(t.ids[0], indexOfMax(logits), `argmax at position ${t.position}`);
      t.ids.forEach((id, k) => {
        worst = Math.max(worst, Math.abs(lp(id) - t.logprobs[k]));
        checked++;
      });
    }
  }
  assert.ok(checked >= 160, `checked ${checked}`);
  assert.ok(worst < 5e-4, `max |logprob - HF| = ${worst}`);
});

test("stop: a chat answer ends at <|im_end|> with finishReason 'stop', and the text omits it", { skip: NO_MODEL }, () => {
  const e = engineOnce();
  const r = e.generate("Say hi.", { chat: true, maxTokens: 24 });
  const imEnd = e.vocab.ids.get("<|im_end|>");
  if (r.finishReason === "stop") {
    assert.equal(r.tokenIds.at(-1), imEnd);
    assert.ok(!r.text.includes("<|im_end|>"));
  } else {
    assert.equal(r.tokenIds.length, 24);
    assert.ok(!r.tokenIds.includes(imEnd));
  }
  // forcing the stop id: the first generated token of the France prompt is " Paris" (7042)
  const s = e.generate(cases[0].prompt_ids, { maxTokens: 10, stopTokenIds: [cases[0].greedy_ids[0]] });
  assert.deepEqual(s.tokenIds, [cases[0].greedy_ids[0]]);
  assert.equal(s.finishReason, "stop");
});

test("onToken can abort; bad requests raise clear errors", { skip: NO_MODEL }, () => {
  const e = engineOnce();
  const seen = [];
  const r = e.generate(cases[0].prompt_ids, { maxTokens: 10, ignoreEos: true }, (id) => { seen.push(id); return seen.length < 3; });
  assert.equal(r.finishReason, "abort");
  assert.deepEqual(r.tokenIds, cases[0].greedy_ids.slice(0, 3));
  assert.throws(() => e.generate([], {}), /prompt is empty/);
  assert.throws(() => e.generate([1, 99999], {}), /prompt token id 99999 out of range/);
  assert.throws(() => e.generate([1], { topP: 0 }), /topP must be in \(0, 1\]/);
  assert.throws(() => e.generate([1], { temperature: -1 }), /temperature must be >= 0/);
  assert.throws(() => e.generate([1], { maxTokens: 1.5 }), /maxTokens must be an integer/);
  assert.throws(() => e.generate([1], { temperature: 1, seed: 0.5 }), /seed must be an integer/);
});

test("a full KV cache ends generation with 'length'; a prompt that cannot fit is refused", { skip: NO_MODEL }, () => {
  const small = loadModel(modelBuffer(), { maxSeqLen: 8, prefillChunk: 2 });
  assert.equal(small.model.maxSeq, 8);
  const c = cases[0]; // 5 prompt tokens -> positions 5, 6, 7 are left: 1 token from the prompt + 3 more
  const r = small.generate(c.prompt_ids, { maxTokens: 20, ignoreEos: true });
  assert.deepEqual(r.tokenIds, c.greedy_ids.slice(0, 4)); // also: prefill in chunks of 2 gives the same tokens
  assert.equal(r.finishReason, "length");
  assert.throws(() => small.generate(cases[1].prompt_ids, {}), /prompt has 18 tokens; maxSeqLen is 8/);
  assert.throws(() => loadModel(modelBuffer(), { maxSeqLen: 0 }), /maxSeqLen must be a positive integer/);
  assert.throws(() => loadModel(modelBuffer(), { prefillChunk: 2.5 }), /prefillChunk must be a positive integer/);
});

function indexOfMax(a) {
  let b = 0;
  for (let i = 1; i < a.length; i++) if (a[i] > a[b]) b = i;
  return b;
}
