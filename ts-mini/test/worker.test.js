// The web-worker protocol (docs/architecture.md), driven through the same handler worker.js installs in a worker.
import { test } from "node:test";
import assert from "node:assert/strict";
import { createHandler } from "../dist/worker.js";
import { loadModel } from "../dist/index.js";
import { NO_MODEL, golden, modelBuffer } from "./helpers.js";

const FRANCE = golden("generation_smollm2.json").cases[0];

function harness() {
  const msgs = [];
  const waiters = [];
  const post = (m) => {
    msgs.push(m);
    for (const w of [...waiters]) if (w.pred(m)) { waiters.splice(waiters.indexOf(w), 1); w.resolve(m); }
  };
  const until = (pred) => {
    const hit = msgs.find(pred);
    return hit ? Promise.resolve(hit) : new Promise((resolve) => waiters.push({ pred, resolve }));
  };
  return { msgs, handle: createHandler(post), until };
}

test("errors before load and on malformed messages", async () => {
  const h = harness();
  h.handle({ type: "generate", id: 1, prompt: "hi" });
  const err = await h.until((m) => m.type === "error");
  assert.equal(err.id, 1);
  assert.match(err.message, /no model loaded/);
  h.handle({ type: "bogus" });
  assert.match(h.msgs.at(-1).message, /unknown message type "bogus"/);
  h.handle({ type: "load", model: new Uint8Array(4) });
  assert.match(h.msgs.at(-1).message, /'model' must be an ArrayBuffer/);
  h.handle({ type: "load", model: new ArrayBuffer(16) });
  assert.match(h.msgs.at(-1).message, /not a GGUF file/);
  assert.equal(h.msgs.at(-1).modelKept, false);
  h.handle(null);
  assert.equal(h.msgs.at(-1).type, "error");
});

test("load -> progress + ready; generate streams tokens then done; cancel aborts", { skip: NO_MODEL }, async () => {
  const h = harness();
  h.handle({ type: "load", model: modelBuffer() });
  const ready = await h.until((m) => m.type === "ready");
  assert.ok(h.msgs.some((m) => m.type === "progress" && m.total > 0));
  assert.equal(ready.info.vocabSize, 49152);
  assert.equal(ready.info.layers, 30);

  // greedy: the golden tokens, streamed one message per token, text adding up
  h.handle({ type: "generate", id: "a", prompt: FRANCE.prompt, maxTokens: 6, temperature: 0 });
  const done = await h.until((m) => m.type === "done" && m.id === "a");
  const toks = h.msgs.filter((m) => m.type === "token" && m.id === "a");
  assert.deepEqual(toks.map((t) => t.tokenId), FRANCE.greedy_ids.slice(0, 6));
  assert.deepEqual(done.tokenIds, FRANCE.greedy_ids.slice(0, 6));
  assert.equal(done.text, toks.map((t) => t.text).join(""));
  assert.ok(done.text.startsWith(" Paris."));
  assert.equal(done.finishReason, "length");
  assert.ok(toks.every((t) => typeof t.ms === "number" && t.ms >= 0));
  assert.ok(done.tokensPerSecond > 0);

  // cancel after the second token: the worker sees it before producing many more
  h.handle({ type: "generate", id: "b", prompt: FRANCE.prompt_ids, maxTokens: 40, temperature: 0.8, topK: 40, topP: 0.9, seed: 1 });
  await h.until((m) => m.type === "token" && m.id === "b" && h.msgs.filter((x) => x.type === "token" && x.id === "b").length >= 2);
  h.handle({ type: "cancel", id: "b" });
  const doneB = await h.until((m) => m.type === "done" && m.id === "b");
  assert.equal(doneB.finishReason, "abort");
  assert.ok(doneB.tokenIds.length <= 3, `generated ${doneB.tokenIds.length} tokens after cancel`);

  // seeded sampling is reproducible across requests; chat wraps the prompt and stops at <|im_end|> (or length)
  const run = async (id) => {
    h.handle({ type: "generate", id, prompt: "Name a color.", chat: true, maxTokens: 8, temperature: 0.9, topP: 0.95, seed: 42 });
    return h.until((m) => m.type === "done" && m.id === id);
  };
  const [c1, c2] = [await run("c1"), await run("c2")];
  assert.deepEqual(c1.tokenIds, c2.tokenIds);
  assert.ok(["stop", "length"].includes(c1.finishReason));
  assert.ok(!c1.text.includes("<|im_end|>"));

  // every option of the sampling law reaches the sampler: the worker's tokens are Engine.start's with the same
  // options, and a different min-p / penalty changes them; a bad value is an error naming the option
  const law = { temperature: 1.3, topK: 60, topP: 0.95, minP: 0.02, repetitionPenalty: 1.3, presencePenalty: 0.5,
    frequencyPenalty: 0.4, logitBias: { 504: 3 }, seed: 2028 };
  const viaWorker = async (id, o) => {
    h.handle({ type: "generate", id, prompt: FRANCE.prompt, maxTokens: 8, ...o });
    return (await h.until((m) => (m.type === "done" || m.type === "error") && m.id === id));
  };
  const direct = (o) => { const g = engine.start(FRANCE.prompt, { maxTokens: 8, ...o }); while (g.step() !== null); return g.tokenIds; };
  const engine = loadModel(modelBuffer());
  const w1 = await viaWorker("law1", law);
  assert.deepEqual(w1.tokenIds, direct(law));
  assert.notDeepEqual(direct({ ...law, logitBias: null, repetitionPenalty: 1 }), w1.tokenIds);
  const bad = await viaWorker("law2", { ...law, minP: 2 });
  assert.equal(bad.type, "error");
  assert.match(bad.message, /minP/);

  // a queued request cancelled before it starts is reported as aborted with nothing generated
  h.handle({ type: "generate", id: "d1", prompt: [504], maxTokens: 3 });
  h.handle({ type: "generate", id: "d2", prompt: [504], maxTokens: 3 });
  h.handle({ type: "cancel", id: "d2" });
  const d2 = await h.until((m) => m.type === "done" && m.id === "d2");
  assert.deepEqual(d2.tokenIds, []);
  assert.equal(d2.finishReason, "abort");
  await h.until((m) => m.type === "done" && m.id === "d1");

  // the demo page sends null for unset options; done carries ttftMs
  h.handle({ type: "generate", id: "n", prompt: FRANCE.prompt, maxTokens: 3, temperature: 0, topP: 1, topK: -1, seed: null, chat: false });
  const n = await h.until((m) => (m.type === "done" || m.type === "error") && m.id === "n");
  assert.equal(n.type, "done", n.message);
  assert.deepEqual(n.tokenIds, FRANCE.greedy_ids.slice(0, 3));
  assert.ok(n.ttftMs > 0);

  // a failed load keeps the previous model, and says so
  h.handle({ type: "load", model: new ArrayBuffer(8) });
  const lf = h.msgs.at(-1);
  assert.equal(lf.type, "error");
  assert.equal(lf.modelKept, true);
  h.handle({ type: "generate", id: "k", prompt: [504], maxTokens: 2 });
  assert.equal((await h.until((m) => m.type === "done" && m.id === "k")).tokenIds.length, 2);

  // bad generation options come back as an error for that id
  h.handle({ type: "generate", id: "e", prompt: "x", topP: 2 });
  const e = await h.until((m) => m.type === "error" && m.id === "e");
  assert.match(e.message, /topP/);
});

test("load from a Blob (a stored model's body): ready, the golden tokens; a truncated Blob keeps the model", { skip: NO_MODEL }, async () => {
  const h = harness();
  h.handle({ type: "load", model: new Blob([modelBuffer()]) });
  const ready = await h.until((m) => m.type === "ready");
  assert.equal(ready.info.vocabSize, 49152);
  h.handle({ type: "generate", id: "b", prompt: FRANCE.prompt, maxTokens: 4, temperature: 0 });
  const done = await h.until((m) => m.type === "done" && m.id === "b");
  assert.deepEqual(done.tokenIds, FRANCE.greedy_ids.slice(0, 4));
  h.handle({ type: "load", model: new Blob([modelBuffer().slice(0, 1 << 20)]) });
  const err = await h.until((m) => m.type === "error");
  assert.match(err.message, /truncated GGUF/);
  assert.equal(err.modelKept, true);
  h.handle({ type: "generate", id: "c", prompt: FRANCE.prompt, maxTokens: 2, temperature: 0 });
  const again = await h.until((m) => m.type === "done" && m.id === "c");
  assert.deepEqual(again.tokenIds, FRANCE.greedy_ids.slice(0, 2));
});
