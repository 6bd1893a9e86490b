// The tab's ts-mini worker under Node, for scripts/measure_web.py's [node] rows: the same protocol handler
// (ts-mini/dist/worker.js createHandler) fed the same messages the page sends, so the only difference from the
// Chromium row is the runtime. Prints one JSON line: {tok_s, cpu_s, ids} of the measured request.
//   node scripts/measure_web_node.mjs DIST MODEL.gguf PROMPT TOKENS THREADS
import { readFileSync } from "node:fs";
import { pathToFileURL } from "node:url";
import path from "node:path";

const [dist, model, prompt, tokens, threads] = process.argv.slice(2);
const { createHandler } = await import(pathToFileURL(path.join(dist, "worker.js")).href);
const bytes = readFileSync(model);
let waiter = null;
const handle = createHandler((m) => { if (["ready", "done", "error"].includes(m.type)) waiter(m); });
const send = (msg) => new Promise((resolve) => { waiter = resolve; handle(msg); });
const check = (m) => { if (m.type === "error") throw new Error(m.message); return m; };
check(await send({ type: "load", model: bytes.buffer.slice(bytes.byteOffset, bytes.byteOffset + bytes.byteLength),
                   threads: Number(threads) }));
check(await send({ type: "generate", id: "warm", prompt, maxTokens: 4, temperature: 0 }));   // warm-up (JIT), as the page run
const c0 = process.cpuUsage();
const r = check(await send({ type: "generate", id: "run", prompt, maxTokens: Number(tokens), temperature: 0 }));
const c = process.cpuUsage(c0);
process.stdout.write(JSON.stringify({ tok_s: r.tokensPerSecond, cpu_s: (c.user + c.system) / 1e6, ids: r.tokenIds }) + "\n");
process.exit(0);   // the pool's helpers are unref'd, but do not wait for them
