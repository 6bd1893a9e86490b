// The sampling law's cases in ts-mini (tests/test_sampling_law.py): one Node process runs them all.
//   node tests/twin_ts_cases.mjs cases.json   ->  stdout: {"tokens": [[ids]...], "streams": [[doubles]...]}
// cases.json: {models: {name: path}, cases: [{model, prompt (text or ids), seed, temperature, top_k, ...}],
//              streams: [[seed, index, count]]}. Text prompts go through ts-mini's tokenizer; id prompts need none.
import { readFileSync } from "node:fs";
import { loadModel } from "../ts-mini/dist/index.js";
import { parseGGUF } from "../ts-mini/dist/04_tensor_table.js";
import { LlamaModel, Generation } from "../ts-mini/dist/18_generate.js";
import { streamFor } from "../ts-mini/dist/17_sampler.js";

const spec = JSON.parse(readFileSync(process.argv[2], "utf8"));
const buffers = {}, engines = {}, bare = {};
const bytes = (name) => {
  if (!buffers[name]) { const b = readFileSync(spec.models[name]); buffers[name] = b.buffer.slice(b.byteOffset, b.byteOffset + b.byteLength); }
  return buffers[name];
};
const tokens = [];
for (const c of spec.cases) {
  const opts = {
    maxTokens: 32, ignoreEos: true, seed: c.seed, temperature: c.temperature ?? 1, topK: c.top_k ?? 0,
    topP: c.top_p ?? 1, minP: c.min_p ?? 0, repetitionPenalty: c.repetition_penalty ?? 1,
    presencePenalty: c.presence_penalty ?? 0, frequencyPenalty: c.frequency_penalty ?? 0, logitBias: c.logit_bias ?? null,
  };
  let gen;
  if (typeof c.prompt === "string") {
    engines[c.model] ??= loadModel(bytes(c.model), { maxSeqLen: 160 });
    gen = engines[c.model].start(c.prompt, opts);
  } else {
    bare[c.model] ??= new LlamaModel(parseGGUF(bytes(c.model)), { maxSeqLen: 160 });
    gen = new Generation(bare[c.model], c.prompt, opts, new Set());
  }
  while (gen.step() !== null);
  tokens.push(gen.tokenIds);
}
const streams = (spec.streams ?? []).map(([seed, index, n]) => {
  const g = streamFor(seed, index);
  return Array.from({ length: n }, () => g.random());
});
process.stdout.write(JSON.stringify({ tokens, streams }) + "\n");
