// node dist/cli.js [MODEL] "prompt" [--max-tokens N] [--temperature T] [--top-k K] [--top-p P] [--seed S] [--chat]
//                  [--threads N]
// Streams the completion to stdout; prints speed to stderr. --threads N: matmul threads (worker_threads sharing
// the weights; default: all cores).

import { availableParallelism } from "node:os";
import { loadModelThreaded } from "./index.js";
import { defaultModelPath, readArrayBuffer } from "./model_path.js";

const USAGE = 'usage: node dist/cli.js [MODEL.gguf] "prompt" [--max-tokens N] [--temperature T] [--top-k K] [--top-p P] [--seed S] [--chat] [--threads N]';

async function main(argv: string[]): Promise<number> {
  const pos: string[] = [];
  const opt: Record<string, string> = {};
  let chat = false;
  for (let i = 0; i < argv.length; i++) {
    const a = argv[i];
    if (a === "--chat") chat = true;
    else if (a === "-h" || a === "--help") { process.stdout.write(USAGE + "\n"); return 0; }
    else if (a.startsWith("--")) {
      if (i + 1 >= argv.length) throw new Error(`${a} needs a value`);
      opt[a.slice(2)] = argv[++i];
    } else pos.push(a);
  }
  if (pos.length < 1 || pos.length > 2) { process.stderr.write(USAGE + "\n"); return 2; }
  const [modelPath, prompt] = pos.length === 2 ? pos : [defaultModelPath(), pos[0]];
  const num = (k: string, d: number) => {
    if (opt[k] === undefined) return d;
    const v = Number(opt[k]);
    if (!Number.isFinite(v)) throw new Error(`--${k} must be a number, got "${opt[k]}"`);
    return v;
  };
  const t0 = performance.now();
  const threads = num("threads", availableParallelism());
  if (!Number.isInteger(threads) || threads < 1) throw new Error(`--threads must be an integer >= 1, got "${opt.threads}"`);
  const engine = await loadModelThreaded(readArrayBuffer(modelPath), { threads });
  if (engine.threadNote) process.stderr.write(`note: ${engine.threadNote}\n`);
  const loadMs = performance.now() - t0;
  const r = engine.generate(prompt, {
    maxTokens: num("max-tokens", 64), temperature: num("temperature", 0), topK: num("top-k", 0),
    topP: num("top-p", 1), seed: opt.seed === undefined ? undefined : num("seed", 0), chat,
  }, (_id, text) => { process.stdout.write(text); });
  process.stdout.write("\n");
  process.stderr.write(`[load ${loadMs.toFixed(0)} ms | prompt ${r.promptTokens} tok in ${r.prefillMs.toFixed(0)} ms | ` +
    `${r.tokenIds.length} tok, ${r.tokensPerSecond.toFixed(2)} tok/s | ${engine.threads} thread(s) | finish: ${r.finishReason}]\n`);
  engine.close();
  return 0;
}

main(process.argv.slice(2)).then((code) => { process.exitCode = code; }, (e) => {
  process.stderr.write(`error: ${(e as Error).message}\n`);
  process.exitCode = 1;
});
