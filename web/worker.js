// Pyodide web worker (module worker): runs the unchanged pyengine wheel on NumPy-in-WebAssembly.
// Protocol (docs/architecture.md, shared with the TypeScript worker):
//   in:  {type:"load", model: ArrayBuffer | Blob, mode?, speculative?, kvCacheDtype?}  {type:"generate", id, prompt,
//        maxTokens, temperature, topP, topK, seed, chat, jsonSchema?}  {type:"cancel", id}
//        (jsonSchema, S15: JSON Schema text constraining the output; "" = any JSON object; `done` then has
//        json: "valid" | "incomplete" | "invalid")
//   out: {type:"progress", stage, loaded, total}  {type:"ready", info}  {type:"token", id, tokenId, text, ms}
//        {type:"done", id, tokenIds, text, tokensPerSecond, finishReason}  {type:"error", id?, message}
// Worker URL parameters: pyodide=<base URL of pyodide.mjs> (default ./vendor/pyodide/, or e.g. the jsDelivr
// CDN; numpy and micropip come from that Pyodide's package index), vendor=<base of manifest.json and wheels/>.
// Extension: `ready` info carries wasm memory figures; `done` carries ttftMs, promptTokens and cachedTokens.
// Extensions for the page's chat and live panel: generate.messages ([{role, content}], the whole conversation
// in the model's chat template, in place of prompt), generate.speculative (false: no S14 drafts for it),
// generate.live (true: a {type:"live", ...} message with the engine's state after every step, see
// pyworker.WorkerSession.live).

const params = new URL(self.location.href).searchParams;
const vendorBase = new URL(params.get("vendor") || "./vendor/", self.location.href).href;
const customPyodide = params.get("pyodide");
const pyodideBase = new URL(customPyodide || "pyodide/", customPyodide ? self.location.href : vendorBase).href;

let py = null;          // the Pyodide instance
let session = null;     // PyProxy of pyworker.WorkerSession
let pumping = false;
let peakWasm = 0;
const liveIds = new Set();  // requests whose page asked for the live panel (generate.live)
const STAGES = ["pyodide", "numpy", "pyengine", "worker"];   // progress: stage k of 4 is starting

const post = (msg) => self.postMessage(msg);
const progress = (stage, loaded, total) => post({ type: "progress", stage, loaded, total });

function wasmBytes() {
  const heap = py && py._module && py._module.HEAPU8;
  const n = heap ? heap.buffer.byteLength : 0;
  peakWasm = Math.max(peakWasm, n);
  return n;
}

function jsHeap() {
  const m = self.performance && self.performance.memory;
  return m ? m.usedJSHeapSize : null;
}

// A readable one-liner from a Python traceback ("GGUFError: bad magic ..."), full text kept for the console.
function readable(err) {
  const text = String((err && err.message) || err);
  const lines = text.split("\n").map((l) => l.trim()).filter(Boolean);
  const last = lines.length ? lines[lines.length - 1] : text;
  return last.replace(/^pyengine\.[\w.]+\./, "");
}

async function boot() {
  const t0 = performance.now();
  progress("pyodide", 0, STAGES.length);
  const { loadPyodide } = await import(pyodideBase + "pyodide.mjs");
  py = await loadPyodide({ indexURL: pyodideBase });
  const manifest = await (await fetch(vendorBase + "manifest.json", { cache: "no-cache" })).json();
  progress("numpy", 1, STAGES.length);         // numpy + micropip
  // By name, through the lock file of whichever Pyodide we booted: the vendored one (whose lock setup_web.sh
  // points at the wheels it ships) or a CDN's.
  await py.loadPackage(["numpy", "micropip"], { messageCallback: () => {} });
  progress("pyengine", 2, STAGES.length);      // micropip.install of our wheel
  const micropip = py.pyimport("micropip");
  await micropip.install.callKwargs(vendorBase + manifest.pyengine, { deps: false });
  micropip.destroy();
  progress("worker", 3, STAGES.length);        // pyworker.py, the Python half of this worker
  const glue = await (await fetch(new URL("./pyworker.py", self.location.href), { cache: "no-cache" })).text();
  const ns = py.globals.get("dict")();
  py.runPython(glue, { globals: ns });
  session = ns.get("WorkerSession")();
  ns.destroy();
  const versions = py.runPython("import sys, numpy, pyengine; f'{sys.version.split()[0]} {numpy.__version__} {pyengine.__version__}'");
  progress("runtime", STAGES.length, STAGES.length);
  return { bootMs: Math.round(performance.now() - t0), versions };
}

const booting = boot().catch((err) => {
  post({ type: "error", message: `Pyodide start-up failed: ${readable(err)}` });
  throw err;
});

async function load(msg) {
  const runtime = await booting;
  const t0 = performance.now();
  if (msg.model instanceof Blob) msg.model = await msg.model.arrayBuffer();   // a stored model (model_store.js)
  progress("model", 0, msg.model.byteLength);
  const u8 = new Uint8Array(msg.model);
  // One copy into the wasm heap (Python bytes); the transferred ArrayBuffer is garbage afterwards.
  py.globals.set("_model_js", u8);
  py.globals.set("_session", session);
  py.globals.set("_mode", msg.mode || undefined);   // undefined -> None (null would be JsNull)
  // S14: {speculative: {method: "ngram", num_speculative_tokens: 4}} as JSON text (pyworker validates it)
  py.globals.set("_spec", msg.speculative ? JSON.stringify(msg.speculative) : undefined);
  py.globals.set("_kv_dtype", msg.kvCacheDtype || undefined);   // "fp16" | "q8_0" | "q4_0" (S08)
  let info;
  try {
    info = py.runPython("_session.load(_model_js.to_bytes(), _mode, speculative=_spec, kv_cache_dtype=_kv_dtype)");
  } finally {
    py.runPython("del _model_js, _session, _mode, _spec, _kv_dtype");
  }
  const out = info.toJs({ dict_converter: Object.fromEntries });
  info.destroy();
  py.runPython("import gc; gc.collect()");
  Object.assign(out, runtime, {
    loadMs: Math.round(performance.now() - t0), modelBytes: u8.byteLength,
    wasmBytes: wasmBytes(), wasmPeakBytes: peakWasm, jsHeapBytes: jsHeap(),
  });
  progress("model", msg.model.byteLength, msg.model.byteLength);
  post({ type: "ready", info: out });
}

// The live panel's message: the engine's state now (after a step of stepWallMs, or after a cancel).
function postLive(stepWallMs) {
  const t0 = performance.now();
  const snap = session.live();
  const m = snap.toJs({ dict_converter: Object.fromEntries });
  snap.destroy();
  m.stepWallMs = stepWallMs;
  m.liveMs = performance.now() - t0;     // what the panel costs this worker per step
  post(m);
}

// A fresh macrotask, so messages queued meanwhile (cancel, generate) run before the next step. Not
// setTimeout(0): nested timers are clamped to >= 4 ms (HTML timers, from the 5th level), measured 4-8 ms a step
// in Chromium's worker; a MessageChannel message is not (the same yield as ts-mini's worker).
function nextTurn() {
  return new Promise((resolve) => {
    const ch = new MessageChannel();
    ch.port1.onmessage = () => { ch.port1.close(); resolve(); };
    ch.port2.postMessage(null);
  });
}

// Run engine steps while requests are pending; yield to the event loop between steps so `cancel`
// (and new `generate`) messages are handled mid-generation.
async function pump() {
  if (pumping) return;
  pumping = true;
  try {
    while (session.has_work()) {
      const t = performance.now();
      let events;
      try {
        const proxy = session.step();
        events = proxy.toJs({ dict_converter: Object.fromEntries });
        proxy.destroy();
      } catch (err) {
        // A failing step poisons every request in flight: report each, then drop them.
        const ids = session.requests.toJs ? [...session.requests.toJs().keys()] : [];
        for (const id of ids) post({ type: "error", id, message: readable(err) });
        session.abort_all();
        liveIds.clear();
        break;
      }
      const ms = performance.now() - t;
      wasmBytes();
      // The live panel (generate.live): the engine's state after this step, posted before its tokens.
      if (liveIds.size) postLive(ms);
      for (const ev of events) {
        if (ev.type === "token") ev.ms = ms;
        else if (ev.type === "done") liveIds.delete(ev.id);
        post(ev);
      }
      await nextTurn();
    }
  } finally {
    pumping = false;
  }
}

async function generate(msg) {
  await booting;
  // messages (multi-turn chat) cross as JSON text; speculative: false opts the request out of S14 drafting
  session.start.callKwargs(String(msg.id), String(msg.prompt ?? ""), msg.maxTokens ?? 64, msg.temperature ?? 1.0,
                msg.topP ?? 1.0, msg.topK ?? -1, msg.seed ?? undefined, !!msg.chat,
                msg.jsonSchema ?? undefined,  // undefined -> None (null is JsNull)
                { messages: msg.messages ? JSON.stringify(msg.messages) : undefined,
                  speculative: msg.speculative ?? undefined });
  if (msg.live) liveIds.add(String(msg.id));
  pump();
}

function cancel(msg) {
  if (!session) return;
  const wasLive = liveIds.delete(String(msg.id));
  const done = session.cancel(String(msg.id));
  if (done) {
    if (wasLive) postLive(0);            // its blocks are back in the pool: the panel shows it
    post(done.toJs({ dict_converter: Object.fromEntries }));
    done.destroy();
  }
}

self.onmessage = async (e) => {
  const msg = e.data || {};
  try {
    if (msg.type === "load") {
      try { await load(msg); } catch (err) {
        // Extension: modelKept says the previous model still serves (pyworker replaces it only on success).
        console.error(err);
        post({ type: "error", message: readable(err), modelKept: !!session && session.has_model() });
      }
    }
    else if (msg.type === "generate") await generate(msg);
    else if (msg.type === "cancel") cancel(msg);
    else if (msg.type === "stats") post({ type: "stats", wasmBytes: wasmBytes(), wasmPeakBytes: peakWasm, jsHeapBytes: jsHeap() });
    else throw new Error(`unknown message type ${JSON.stringify(msg.type)}`);
  } catch (err) {
    console.error(err);
    post({ type: "error", id: msg.id, message: readable(err) });
  }
};
