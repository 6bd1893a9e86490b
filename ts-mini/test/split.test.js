// Split GGUF (04b): the parts of SmolLM2 written by pyengine's write_split join into one buffer that gives
// HF's greedy tokens; a missing, extra or misplaced part is refused by number; the worker takes the parts.
import { test } from "node:test";
import assert from "node:assert/strict";
import { execFileSync } from "node:child_process";
import { mkdtempSync, readFileSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { joinSplit, loadModel, parseGGUF, splitPartNames } from "../dist/index.js";
import { createHandler } from "../dist/worker.js";
import { MODEL_PATH, NO_MODEL, REPO, golden } from "./helpers.js";

const FRANCE = golden("generation_smollm2.json").cases[0];

function writeParts() {
  const dir = mkdtempSync(join(tmpdir(), "ts-split-"));
  const out = execFileSync(`${REPO}.venv/bin/python`, ["-c",
    "import sys; from pyengine.gguf import GGUFFile; from pyengine.gguf.split import write_split; " +
    "print('\\n'.join(write_split(GGUFFile(sys.argv[1]), sys.argv[2], 100)))", MODEL_PATH, join(dir, "smol")],
  { encoding: "utf8", cwd: REPO });
  const paths = out.trim().split("\n");
  const bufs = paths.map((p) => { const b = readFileSync(p); return b.buffer.slice(b.byteOffset, b.byteOffset + b.byteLength); });
  rmSync(dir, { recursive: true, force: true });
  return { paths, bufs };
}

test("part names follow llama.cpp's pattern", () => {
  assert.deepEqual(splitPartNames("m-00001-of-00003.gguf"), ["m-00001-of-00003.gguf", "m-00002-of-00003.gguf", "m-00003-of-00003.gguf"]);
  assert.equal(splitPartNames("m-00002-of-00003.gguf"), null);
  assert.equal(splitPartNames("model.gguf"), null);
});

test("joined parts = the single file: same tensors, HF's greedy tokens; bad part lists refused", { skip: NO_MODEL }, async () => {
  const { paths, bufs } = writeParts();
  assert.equal(paths.length, 3);
  assert.ok(paths[0].endsWith("smol-00001-of-00003.gguf"));
  const joined = joinSplit(bufs);
  const g = parseGGUF(joined), single = parseGGUF(readFileSync(MODEL_PATH).buffer);
  assert.equal(g.tensors.size, single.tensors.size);
  assert.equal(g.metadata.get("split.count"), 1);
  const e = loadModel(joined);
  const r = e.generate(FRANCE.prompt_ids, { maxTokens: 6, temperature: 0, ignoreEos: true });
  assert.deepEqual(r.tokenIds, FRANCE.greedy_ids.slice(0, 6));

  assert.throws(() => joinSplit(bufs.slice(0, 2)), /3 parts, 2 given \(part 3 is missing\)/);
  assert.throws(() => joinSplit([bufs[0], bufs[2], bufs[1]]), /part 2 of 3 does not belong here: it says part 3 of 3/);
  assert.throws(() => joinSplit([bufs[1], bufs[0], bufs[2]]), /is part 2 of 3: start with part 1/);
  assert.throws(() => joinSplit([bufs[0], bufs[1], new ArrayBuffer(8)]), /split GGUF part 3 of 3: not a GGUF file/);

  // the worker protocol takes the parts as an array
  const msgs = [];
  const handle = createHandler((m) => msgs.push(m));
  handle({ type: "load", model: bufs.slice(0, 2) });
  assert.match(msgs.at(-1).message, /part 3 is missing/);
  handle({ type: "load", model: bufs });
  assert.equal(msgs.at(-1).type, "ready", msgs.at(-1).message);
});
