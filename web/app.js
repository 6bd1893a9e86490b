// The demo page: one web worker per engine (Pyodide/pyengine and TypeScript ts-mini), both speaking the
// worker protocol of docs/architecture.md. Also the scripting API `window.pyengineDemo` used by e2e tests:
//   ready                    resolves once the page is wired and both workers are started (it does NOT wait
//                            for Pyodide to boot or for a model; loadModel() and generate() wait as needed)
//   loadModel(src)           src: URL string | ArrayBuffer | Blob/File -> {python: info, ts: info}; rejects with
//                            a readable Error if an available engine refuses the file (the page keeps working)
//   generate({engine, prompt, maxTokens, temperature, topP, topK, seed, chat})
//                            -> {tokenIds, text, tokensPerSecond, finishReason, ttftMs, tokenMs}
//   cancel(engine)           stops that engine's running generation (its promise resolves, finishReason "abort")
//   state()                  {python: {status, info, error}, ts: {...}}
//   stats(engine)            Python worker only: {wasmBytes, wasmPeakBytes, jsHeapBytes} (null for others)
import { fetchModel as fetchStoredModel, fetchSplitModel, forgetAll, splitParts } from "./model_store.js";

const cfg = Object.assign({ defaultModel: null, pyodide: null, vendor: "./vendor/", tsWorker: "./ts-mini/worker.js" },
                          window.PYENGINE_CONFIG || {});
const query = new URLSearchParams(location.search);
if (query.get("pyodide")) cfg.pyodide = query.get("pyodide");
const abs = (u) => new URL(u, location.href).href;
const $ = (id) => document.getElementById(id);

const ENGINES = { python: { label: "Python", color: "#3572A5" }, ts: { label: "TypeScript", color: "#d9822b" } };

class EngineClient {
  constructor(name, url) {
    this.name = name;
    this.pane = $(`engine-${name}`);
    this.status = "starting";
    this.info = null;
    this.error = null;
    this.loadWaiter = null;
    this.running = new Map();      // request id -> {resolve, reject, tokens, ms}
    this.nextId = 0;
    this.modelReady = null;        // promise of the latest load
    try {
      this.worker = new Worker(url, { type: "module" });
    } catch (err) {
      this.fail(`worker could not start: ${err.message}`);
      return;
    }
    this.worker.onmessage = (e) => this.onMessage(e.data);
    // A module worker that cannot be fetched/parsed only fires a bare `error` event.
    this.worker.onerror = (e) => {
      e.preventDefault();
      this.fail(`worker failed to load (${e.message || url}); is it built? (scripts/setup_web.sh)`);
    };
  }

  get available() { return this.status !== "unavailable"; }

  role(r) { return this.pane.querySelector(`[data-role="${r}"]`); }

  setStatus(text) { this.role("status").textContent = text; }

  showError(message) {
    const el = this.role("error");
    el.textContent = message || "";
    el.hidden = !message;
  }

  fail(message) {
    this.status = "unavailable";
    this.error = message;
    this.setStatus("unavailable");
    this.showError(message);
    if (this.loadWaiter) { this.loadWaiter.reject(new Error(message)); this.loadWaiter = null; }
    for (const r of this.running.values()) r.reject(new Error(message));
    this.running.clear();
    updateButtons();
  }

  onMessage(msg) {
    switch (msg.type) {
      case "progress": {
        const bar = this.role("progress");
        bar.max = msg.total || 1;
        bar.value = msg.loaded || 0;
        if (this.status !== "ready" || msg.stage === "model") this.setStatus(`${msg.stage}…`);
        if (msg.stage === "runtime" && this.status === "starting") {
          this.status = "idle";
          this.setStatus("runtime ready, waiting for a model");
        }
        break;
      }
      case "ready":
        this.status = "ready";
        this.info = msg.info || {};
        this.error = null;
        this.showError("");
        this.setStatus(describeInfo(this.info));
        if (this.loadWaiter) { this.loadWaiter.resolve(this.info); this.loadWaiter = null; }
        updateButtons();
        break;
      case "token": {
        const r = this.running.get(msg.id);
        if (!r) break;
        r.tokens.push(msg.tokenId);
        r.ms.push(msg.ms);
        this.role("output").textContent += msg.text || "";
        plot.add(this.name, msg.ms);
        this.role("stats").textContent = `${r.tokens.length} tokens, last ${msg.ms.toFixed(0)} ms`;
        break;
      }
      case "done": {
        const r = this.running.get(msg.id);
        if (!r) break;
        this.running.delete(msg.id);
        this.role("output").textContent = msg.text;
        const tps = msg.tokensPerSecond || 0;
        this.role("stats").textContent = `${msg.tokenIds.length} tokens, ${tps.toFixed(2)} tok/s` +
          (msg.ttftMs != null ? `, first token ${msg.ttftMs.toFixed(0)} ms` : "") + ` (${msg.finishReason})` +
          (msg.json ? ` — JSON ${msg.json === "valid" ? "valid \u2713" : msg.json}` : "");
        r.resolve({ tokenIds: msg.tokenIds, text: msg.text, tokensPerSecond: tps, finishReason: msg.finishReason,
                    ttftMs: msg.ttftMs ?? null, tokenMs: r.ms, json: msg.json ?? null });
        updateButtons();
        break;
      }
      case "stats":        // extension of the Python worker: its wasm memory figures
        if (this.statsWaiter) { this.statsWaiter(msg); this.statsWaiter = null; }
        break;
      case "error": {
        const message = `${ENGINES[this.name].label}: ${msg.message}`;
        if (msg.id != null && this.running.has(msg.id)) {
          const r = this.running.get(msg.id);
          this.running.delete(msg.id);
          r.reject(new Error(message));
        } else if (this.loadWaiter) {
          this.loadWaiter.reject(new Error(message));
          this.loadWaiter = null;
          // Only a worker that says so (modelKept) still has its previous model; otherwise it has none.
          if (!msg.modelKept) this.info = null;
          this.setStatus(this.info ? `${describeInfo(this.info)} (previous model kept)` : "no model loaded");
          this.status = this.info ? "ready" : "idle";
        } else if (this.status === "starting") {
          this.fail(msg.message);
        }
        this.showError(message);
        showError(message);
        updateButtons();
        break;
      }
    }
  }

  load(buffer, transfer) {
    if (!this.available) return Promise.reject(new Error(this.error));
    if (this.loadWaiter) this.loadWaiter.reject(new Error("superseded by a newer load"));
    this.status = "loading";
    this.showError("");
    this.setStatus("loading model…");
    const msg = { type: "load", model: buffer };
    if (this.name === "python") {
      // fp32 weights ("resident") decode ~2.4x faster but take ~900 MB; small devices get "lean" (~320 MB).
      const small = navigator.deviceMemory && navigator.deviceMemory < 4;
      const mode = query.get("pymode") || (small ? "lean" : null);
      if (mode) msg.mode = mode;
      const kv = query.get("pykv");            // KV cache storage: fp16 | q8_0 | q4_0 (default float32)
      if (kv) msg.kvCacheDtype = kv;
    }
    // ts-mini: matmul threads (?threads=N; default all cores; one when the page is not cross-origin isolated)
    if (this.name === "ts") msg.threads = Number(query.get("threads")) || navigator.hardwareConcurrency || 1;
    this.modelReady = new Promise((resolve, reject) => { this.loadWaiter = { resolve, reject }; });
    this.worker.postMessage(msg, transfer ? [buffer] : []);
    updateButtons();
    return this.modelReady;
  }

  async generate(opts) {
    if (!this.available) throw new Error(this.error);
    if (this.status === "loading" && this.modelReady) await this.modelReady;
    if (this.status !== "ready") throw new Error(`${ENGINES[this.name].label}: no model loaded`);
    const id = `${this.name}-${++this.nextId}`;
    this.role("output").textContent = "";
    this.role("stats").textContent = "";
    this.showError("");
    plot.reset(this.name);
    const done = new Promise((resolve, reject) => this.running.set(id, { resolve, reject, tokens: [], ms: [] }));
    const msg = {
      type: "generate", id, prompt: opts.prompt ?? "", maxTokens: opts.maxTokens ?? 64,
      temperature: opts.temperature ?? 0, topP: opts.topP ?? 1, topK: opts.topK ?? -1, chat: !!opts.chat,
    };
    if (opts.seed != null) msg.seed = opts.seed;     // no seed: leave the field out (engines pick one)
    if (opts.jsonSchema != null && this.name === "python") msg.jsonSchema = opts.jsonSchema;  // S15 JSON mode
    this.worker.postMessage(msg);
    updateButtons();
    return done;
  }

  stats() {
    if (this.name !== "python") return Promise.resolve(null);
    return new Promise((resolve) => { this.statsWaiter = resolve; this.worker.postMessage({ type: "stats" }); });
  }

  cancel() {
    for (const id of this.running.keys()) this.worker.postMessage({ type: "cancel", id });
  }
}

function describeInfo(info) {
  const mb = (n) => (n ? `${(n / 1048576).toFixed(0)} MB` : "");
  const parts = [info.name || info.arch || "model", info.layers ? `${info.layers} layers` : "",
                 info.loadMs ? `loaded in ${(info.loadMs / 1000).toFixed(1)} s` : "",
                 info.wasmBytes ? `wasm memory ${mb(info.wasmBytes)}` : "",
                 info.threads ? `${info.threads} thread${info.threads > 1 ? "s" : ""}` : "", info.threadNote || "",
                 info.threadNote && window.PYENGINE_COI === "shim-installed" ? "reload the page to use all cores" : ""];
  return "ready: " + parts.filter(Boolean).join(", ");
}

// ---- latency plot: one line per engine, x = token index, y = ms (no libraries) ----
const plot = {
  series: { python: [], ts: [] },
  pending: false,
  reset(name) { this.series[name] = []; this.draw(); },
  add(name, ms) {
    this.series[name].push(ms);
    if (!this.pending) { this.pending = true; requestAnimationFrame(() => { this.pending = false; this.draw(); }); }
  },
  draw() {
    const c = $("latency");
    if (!c) return;
    const g = c.getContext("2d");
    const W = c.width, H = c.height, L = 48, B = 24, T = 10, R = 10;
    g.clearRect(0, 0, W, H);
    const all = [...this.series.python, ...this.series.ts];
    const n = Math.max(2, this.series.python.length, this.series.ts.length);
    const ymax = Math.max(10, ...all) * 1.1;
    g.strokeStyle = "#999"; g.fillStyle = "#555"; g.font = "11px sans-serif"; g.lineWidth = 1;
    g.beginPath(); g.moveTo(L, T); g.lineTo(L, H - B); g.lineTo(W - R, H - B); g.stroke();
    for (let k = 0; k <= 4; k++) {
      const v = (ymax * k) / 4, y = H - B - ((H - B - T) * k) / 4;
      g.fillText(v.toFixed(0), 4, y + 4);
      g.strokeStyle = "#eee"; g.beginPath(); g.moveTo(L + 1, y); g.lineTo(W - R, y); g.stroke();
    }
    g.fillStyle = "#555"; g.fillText("token", W - R - 30, H - 6); g.fillText("0", L, H - 6); g.fillText(String(n - 1), W - R - 60, H - 6);
    let legendX = L + 10;
    for (const [name, data] of Object.entries(this.series)) {
      g.strokeStyle = ENGINES[name].color; g.lineWidth = 1.5;
      g.beginPath();
      data.forEach((v, i) => {
        const x = L + ((W - L - R) * i) / (n - 1), y = H - B - ((H - B - T) * v) / ymax;
        if (i === 0) g.moveTo(x, y); else g.lineTo(x, y);
      });
      g.stroke();
      g.fillStyle = ENGINES[name].color;
      g.fillRect(legendX, T + 2, 10, 10);
      g.fillText(ENGINES[name].label, legendX + 14, T + 11);
      legendX += 100;
    }
  },
};

// ---- page-level state and controls ----
const engines = {};
let modelLoad = null;

function showError(message) {
  const el = $("error");
  el.textContent = message || "";
  el.hidden = !message;
}

function updateButtons() {
  const anyReady = Object.values(engines).some((e) => e.status === "ready");
  const anyRunning = Object.values(engines).some((e) => e.running.size > 0);
  $("generate").disabled = !anyReady || anyRunning;
  $("stop").disabled = !anyRunning;
}

async function loadModel(source, name) {
  showError("");
  let buffer;
  let stored = null;
  if (typeof source === "string") {
    name = name || source.split("/").pop();
    const bar = $("download-progress"), label = $("download-label");
    const progress = (loaded, total) => {
      bar.max = total || loaded; bar.value = loaded;
      label.textContent = `${(loaded / 1048576).toFixed(1)}${total ? ` / ${(total / 1048576).toFixed(1)}` : ""} MB`;
    };
    const parts = splitParts(source);   // "-00001-of-0000N.gguf": fetch every part, join them (ts-mini's joinSplit)
    if (parts) {
      const { joinSplit } = await import(new URL("04b_split.js", abs(cfg.tsWorker)).href);
      stored = await fetchSplitModel(parts, progress, joinSplit);
      name = `${name} (+${parts.length - 1} parts)`;
    } else stored = await fetchStoredModel(source, progress);
    buffer = stored.buffer;
    storeStatus(stored);
  }
  else if (source instanceof ArrayBuffer) buffer = source;
  else if (source && typeof source.arrayBuffer === "function") { name = name || source.name; buffer = await source.arrayBuffer(); }
  else throw new Error("loadModel: expected a URL, an ArrayBuffer or a File");
  $("model-label").textContent = `${name || "model"} (${(buffer.byteLength / 1048576).toFixed(1)} MB): loading…`;
  const live = Object.values(engines).filter((e) => e.available);
  // Each worker gets its own copy; the last one takes the original by transfer (no copy).
  const results = await Promise.allSettled(live.map((e, i) =>
    e.load(i === live.length - 1 ? buffer : buffer.slice(0), i === live.length - 1)));
  const out = {};
  const errors = [];
  live.forEach((e, i) => {
    if (results[i].status === "fulfilled") out[e.name] = results[i].value;
    else errors.push(results[i].reason.message);
  });
  $("model-label").textContent = errors.length ? `${name || "model"}: not loaded` : `${name || "model"}: loaded`;
  if (stored) storeStatus(await stored.storing, stored);
  if (errors.length) {
    const message = errors.join("; ");
    showError(message);
    throw new Error(message);
  }
  return out;
}

function guarded(promise) {
  // UI actions: errors are already shown on the page; keep them off the console's unhandled list.
  return promise.catch((err) => { showError(err.message); });
}

function sampling() {
  const num = (id) => Number($(id).value);
  return { prompt: $("prompt").value, maxTokens: num("max-tokens"), temperature: num("temperature"),
           topP: num("top-p"), topK: num("top-k"), seed: $("seed").value === "" ? null : num("seed"),
           chat: $("chat").checked, jsonSchema: $("json-mode").checked ? $("json-schema").value : null };
}

// The "model store" status line (web/model_store.js): from cache / stored / not stored (and why).
function storeStatus(s, first) {
  const el = $("store-status"), mb = (n) => `${(n / 1048576).toFixed(1)} MB`;
  if (!el) return;
  const r = first || s;
  if (r.fromCache) el.textContent = `from cache (${mb(r.storedBytes)} stored)${r.note ? ` — ${r.note}` : ""}`;
  else if (s.stored === true) el.textContent = `downloaded; stored for next visit (${mb(s.bytes)})`;
  else if (s.stored === false) el.textContent = s.message;
  else el.textContent = "downloaded; storing…";
}

function init() {
  const pyParams = new URLSearchParams({ vendor: abs(cfg.vendor) });
  if (cfg.pyodide) pyParams.set("pyodide", abs(cfg.pyodide));
  const wanted = (query.get("engines") || "python,ts").split(",");   // ?engines=ts: start only that worker
  if (wanted.includes("python")) engines.python = new EngineClient("python", `${abs("./worker.js")}?${pyParams}`);
  if (wanted.includes("ts")) engines.ts = new EngineClient("ts", abs(cfg.tsWorker));

  $("forget-models").addEventListener("click", () => guarded(forgetAll().then((n) => {
    $("store-status").textContent = `forgot ${n} stored model${n === 1 ? "" : "s"}`;
  })));
  $("model-file").addEventListener("change", (e) => {
    const f = e.target.files[0];
    if (f) guarded(loadModel(f));
    e.target.value = "";
  });
  const dz = $("dropzone");
  dz.addEventListener("dragover", (e) => { e.preventDefault(); dz.classList.add("over"); });
  dz.addEventListener("dragleave", () => dz.classList.remove("over"));
  dz.addEventListener("drop", (e) => {
    e.preventDefault();
    dz.classList.remove("over");
    const f = e.dataTransfer.files[0];
    if (f) guarded(loadModel(f));
  });
  if (cfg.defaultModel) {
    $("default-model-wrap").hidden = false;
    $("use-default").addEventListener("click", () => guarded(loadModel(abs(cfg.defaultModel))));
  }
  $("generate").addEventListener("click", () => {
    showError("");
    const opts = sampling();
    for (const e of Object.values(engines)) if (e.status === "ready") guarded(e.generate(opts));
  });
  $("stop").addEventListener("click", () => Object.values(engines).forEach((e) => e.cancel()));
  $("json-mode").addEventListener("change", () => { $("json-schema-row").hidden = !$("json-mode").checked; });
  plot.draw();
  updateButtons();
  if (query.get("model")) guarded(loadModel(abs(query.get("model"))));
}

init();
window.pyengineDemo = {
  ready: Promise.resolve(),
  config: cfg,
  loadModel: (src, name) => loadModel(src, name),
  generate: (opts) => {
    const e = engines[opts.engine || "python"];
    if (!e) return Promise.reject(new Error(`unknown engine ${opts.engine}`));
    return e.generate(opts);
  },
  cancel: (engine) => { (engine ? [engines[engine]] : Object.values(engines)).forEach((e) => e && e.cancel()); },
  stats: (engine) => (engines[engine || "python"] ? engines[engine || "python"].stats() : Promise.resolve(null)),
  state: () => Object.fromEntries(Object.entries(engines).map(([k, e]) =>
    [k, { status: e.status, info: e.info, error: e.error, running: e.running.size }])),
};
