// The matmul worker pool (13b): N threads sharing the weights and the arena give exactly the single-thread
// results (same kernels, only split by rows) and HF's greedy tokens; closing the pool falls back to one thread.
import { test } from "node:test";
import assert from "node:assert/strict";
import { loadModelThreaded } from "../dist/index.js";
import { partStart } from "../dist/13b_matmul_pool.js";
import { createHandler } from "../dist/worker.js";
import { NO_MODEL, engineOnce, golden, modelBuffer } from "./helpers.js";

const GEN = golden("generation_smollm2.json");

test("row parts are even-aligned, ordered and cover every row", () => {
  for (const rows of [1, 2, 7, 192, 576, 1536, 49152]) {
    for (const n of [2, 3, 4, 8]) {
      let prev = 0;
      for (let k = 0; k <= n; k++) {
        const s = partStart(rows, k, n);
        assert.ok(s >= prev && (s % 2 === 0 || s === rows), `rows ${rows} n ${n} k ${k}: ${s}`);
        prev = s;
      }
      assert.equal(partStart(rows, 0, n), 0);
      assert.equal(partStart(rows, n, n), rows);
    }
  }
});

test("3 threads: greedy tokens equal HF's and the logits equal one thread's bit for bit", { skip: NO_MODEL }, async () => {
  const one = engineOnce();
  const many = await loadModelThreaded(modelBuffer(), { threads: 3 });
  try {
    assert.equal(many.threads, 3, many.threadNote ?? "");
    assert.ok(many.model.arena.buffer instanceof SharedArrayBuffer);
    const c = GEN.cases.find((k) => k.prompt.startsWith("def fibonacci"));
    const r = many.generate(c.prompt_ids, { maxTokens: 8, ignoreEos: true });
    assert.deepEqual(r.tokenIds, c.greedy_ids.slice(0, 8));
    // prefill of 40 tokens (matmul path, two chunks) and decode steps (matvec path), compared exactly
    const ids = GEN.cases[1].prompt_ids.concat(GEN.cases[2].prompt_ids).slice(0, 40);
    const a = Float32Array.from(one.model.prefill(ids)), b = Float32Array.from(many.model.prefill(ids));
    assert.deepEqual(b, a);
    const a1 = Float32Array.from(one.model.forward([7], 0, 1, ids.length));
    const b1 = Float32Array.from(many.model.forward([7], 0, 1, ids.length));
    assert.deepEqual(b1, a1);
    many.close();
    assert.equal(many.threads, 1);
    const after = many.generate(c.prompt_ids, { maxTokens: 4, ignoreEos: true });
    assert.deepEqual(after.tokenIds, c.greedy_ids.slice(0, 4));
  } finally {
    many.close();
  }
});

test("bad thread counts are refused; threads: 1 is a plain engine", { skip: NO_MODEL }, async () => {
  await assert.rejects(loadModelThreaded(modelBuffer(), { threads: 0 }), /threads must be an integer >= 1/);
  await assert.rejects(loadModelThreaded(modelBuffer(), { threads: 1.5 }), /threads must be an integer >= 1/);
  const e = await loadModelThreaded(modelBuffer(), { threads: 1 });
  assert.equal(e.threads, 1);
  assert.ok(!(e.model.arena.buffer instanceof SharedArrayBuffer));
});

test("worker protocol: load with threads: 2 reports the threads and streams HF's greedy tokens", { skip: NO_MODEL }, async () => {
  const msgs = [];
  let wake = null;
  const handle = createHandler((m) => { msgs.push(m); if (wake) wake(); });
  const until = async (pred) => {
    for (;;) {
      const hit = msgs.find(pred);
      if (hit) return hit;
      await new Promise((r) => { wake = r; });
    }
  };
  handle({ type: "load", model: new ArrayBuffer(16), threads: 2 }); // refused at once, before any thread starts
  assert.match(msgs.at(-1).message, /not a GGUF file/);
  handle({ type: "load", model: modelBuffer(), threads: 0 });
  assert.match(msgs.at(-1).message, /threads must be an integer >= 1/);
  handle({ type: "load", model: modelBuffer(), threads: 2 });
  const c = GEN.cases[0];
  handle({ type: "generate", id: "g", prompt: c.prompt_ids, maxTokens: 5, temperature: 0 }); // waits for the load
  const ready = await until((m) => m.type === "ready");
  assert.equal(ready.info.threads, 2, ready.info.threadNote ?? "");
  const done = await until((m) => (m.type === "done" || m.type === "error") && m.id === "g");
  assert.deepEqual(done.tokenIds, c.greedy_ids.slice(0, 5));
  handle({ type: "load", model: modelBuffer() }); // back to one thread: the pool of the old engine is closed
  assert.equal(msgs.at(-1).info.threads, 1);
});
