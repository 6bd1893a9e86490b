// The demo page: one web worker per engine (Pyodide/pyengine and TypeScript ts-mini), both speaking the
// worker protocol of docs/architecture.md. Also the scripting API `window.pyengineDemo` used by e2e tests:
//   ready                    resolves once the page is wired and both workers are started (it does NOT wait
//                            for Pyodide to boot or for a model; loadModel() and generate() wait as needed)
//   loadModel(src)           src: URL string | ArrayBuffer | Blob/File -> {python: info, ts: info} of the engines
//                            that loaded it, plus `refused: {engine: message}` when one engine refused it (the
//                            other keeps serving); rejects with a readable Error only if no engine loaded it
//   loads()                  per-engine result of the latest load: {python: {ok, info?, error?}, ts: {...}}
//   generate({engine, prompt, messages, maxTokens, temperature, topP, topK, seed, chat, jsonSchema,
//             speculative, live})
//                            one engine -> {tokenIds, text, tokensPerSecond, finishReason, ttftMs, tokenMs, ...}
//   run(opts)                what the Generate button does: every engine with a model (waiting for one that is
//                            still loading), one after the other unless opts.sideBySide; per-engine overrides in
//                            opts.python / opts.ts -> {python, ts, agreement, alone}
//   chat(text, opts)         one chat turn in both engines (each keeps its own history; a stopped turn is not
//                            kept) -> as run(); clearChat(); conversation() -> {python: [...], ts: [...]}
//   agreement()              the latest comparison {state: "identical"|"diverged"|..., index, tokens}
//   live()                   the latest live snapshot of the Python engine (see pyworker.WorkerSession.live)
//   liveCost()               {steps, liveMs, stepMs}: the snapshots' time in the worker over the latest live request
//   cancel(engine)           stops that engine's running generation (its promise resolves, finishReason "abort")
//   state()                  {python: {status, info, error, running, load}, ts: {...}}
//   stats(engine)            Python worker only: {wasmBytes, wasmPeakBytes, jsHeapBytes} (null for others)
import { fetchModel as fetchStoredModel, fetchSplitModel, forgetAll, splitParts } from "./model_store.js";

const cfg = Object.assign({ defaultModel: null, pyodide: null, vendor: "./vendor/", tsWorker: "./ts-mini/worker.js",
                            sourceBase: null }, window.PYENGINE_CONFIG || {});
const query = new URLSearchParams(location.search);
if (query.get("pyodide")) cfg.pyodide = query.get("pyodide");
const abs = (u) => new URL(u, location.href).href;
const $ = (id) => document.getElementById(id);

const ENGINES = { python: { label: "Python", color: "#3572A5" }, ts: { label: "TypeScript", color: "#d9822b" } };
// S14 for the Python engine: loaded with an n-gram proposer; each request opts in with the page's switch.
const SPECULATIVE = { method: "ngram", num_speculative_tokens: 4 };
const PAINT_MS = 250;   // streamed tokens are drawn at most this often (EngineClient.schedulePaint)

class EngineClient {
  constructor(name, url) {
    this.name = name;
    this.pane = $(`engine-${name}`);
    this.status = "starting";
    this.info = null;
    this.error = null;
    this.load = null;              // result of the latest load: {ok, info} | {ok: false, error}
    this.sittingOut = false;       // refused the page's current model while the other engine took it
    this.loadWaiter = null;
    this.running = new Map();      // request id -> {resolve, reject, tokens, ms, spans}
    this.nextId = 0;
    this.paintedAt = -Infinity;     // when streamed tokens last reached the DOM (schedulePaint)
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

  // Streamed tokens reach the DOM at most every PAINT_MS (one batch of spans, the stats line, one plot draw):
  // painting after every token cost the page's main thread and compositor ~4.5 ms of CPU per token, which on
  // two cores came out of the engine's decode (docs/performance.md, "the tab against Node").
  schedulePaint(r) {
    if (r.timer !== null) return;
    const wait = Math.max(0, PAINT_MS - (performance.now() - this.paintedAt));
    r.timer = setTimeout(() => requestAnimationFrame(() => this.paint(r)), wait);
  }

  paint(r) {
    if (r.timer !== null) { clearTimeout(r.timer); r.timer = null; }
    if (!r.unpainted.length) return;
    // one span per token (S22's agreement badge highlights the first divergent one)
    const frag = document.createDocumentFragment();
    let i = r.tokens.length - r.unpainted.length;
    for (const msg of r.unpainted) {
      const span = document.createElement("span");
      span.dataset.i = String(i++);
      span.dataset.token = String(msg.tokenId);
      span.textContent = msg.text || "";
      frag.appendChild(span);
    }
    this.role("output").appendChild(frag);
    plot.add(this.name, ...r.unpainted.map((m) => m.ms));
    const last = r.unpainted[r.unpainted.length - 1];
    this.role("stats").textContent = `${r.tokens.length} tokens, last ${last.ms.toFixed(0)} ms`;
    r.unpainted = [];
    this.paintedAt = performance.now();
  }

  get available() { return this.status !== "unavailable"; }

  get label() { return ENGINES[this.name].label; }

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
        this.load = { ok: true, info: this.info };
        this.showError("");
        this.setStatus(describeInfo(this.info));
        if (this.name === "ts") livePanel.arena(this.info);
        if (this.loadWaiter) { this.loadWaiter.resolve(this.info); this.loadWaiter = null; }
        updateButtons();
        break;
      case "token": {
        const r = this.running.get(msg.id);
        if (!r) break;
        r.tokens.push(msg.tokenId);
        r.ms.push(msg.ms);
        r.unpainted.push(msg);
        this.schedulePaint(r);
        break;
      }
      case "live":
        livePanel.update(msg);
        break;
      case "done": {
        const r = this.running.get(msg.id);
        if (!r) break;
        this.running.delete(msg.id);
        this.paint(r);
        // The streamed spans stay when they spell the final text (stop strings can cut it); else plain text.
        const out = this.role("output");
        const spans = [...out.querySelectorAll("span[data-i]")];
        if (spans.length !== msg.tokenIds.length || spans.map((s) => s.textContent).join("") !== msg.text) {
          out.textContent = msg.text;
        }
        const tps = msg.tokensPerSecond || 0;
        const spec = msg.numDraftTokens ? `, drafts ${msg.numAcceptedTokens}/${msg.numDraftTokens} accepted` : "";
        this.role("stats").textContent = `${msg.tokenIds.length} tokens, ${tps.toFixed(2)} tok/s` +
          (msg.ttftMs != null ? `, first token ${msg.ttftMs.toFixed(0)} ms` : "") + ` (${msg.finishReason})` + spec +
          (msg.json ? ` — JSON ${msg.json === "valid" ? "valid \u2713" : msg.json}` : "");
        if (this.name === "python") livePanel.done(msg);
        r.resolve({ tokenIds: msg.tokenIds, text: msg.text, tokensPerSecond: tps, finishReason: msg.finishReason,
                    ttftMs: msg.ttftMs ?? null, tokenMs: r.ms, json: msg.json ?? null,
                    promptTokens: msg.promptTokens ?? null, cachedTokens: msg.cachedTokens ?? null,
                    numDraftTokens: msg.numDraftTokens ?? 0, numAcceptedTokens: msg.numAcceptedTokens ?? 0 });
        updateButtons();
        break;
      }
      case "stats":        // extension of the Python worker: its wasm memory figures
        if (this.statsWaiter) { this.statsWaiter(msg); this.statsWaiter = null; }
        break;
      case "error": {
        const message = `${this.label}: ${msg.message}`;
        if (msg.id != null && this.running.has(msg.id)) {
          const r = this.running.get(msg.id);
          this.running.delete(msg.id);
          this.paint(r);             // what streamed before the error stays visible
          r.reject(new Error(message));
        } else if (this.loadWaiter) {
          this.loadWaiter.reject(new Error(message));
          this.loadWaiter = null;
          // Only a worker that says so (modelKept) still has its previous model; otherwise it has none.
          if (!msg.modelKept) this.info = null;
          this.load = { ok: false, error: msg.message, modelKept: !!msg.modelKept };
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

  loadModel(buffer, transfer) {
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
      msg.speculative = SPECULATIVE;           // S14: requests opt in (generate.speculative)
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
    if (this.status === "loading" && this.modelReady) await this.modelReady.catch(() => {});
    if (this.status !== "ready") throw new Error(`${this.label}: no model loaded`);
    const id = `${this.name}-${++this.nextId}`;
    this.role("output").textContent = "";
    this.role("stats").textContent = "";
    this.showError("");
    plot.reset(this.name);
    const done = new Promise((resolve, reject) => this.running.set(id, { resolve, reject, tokens: [], ms: [],
                                                                         unpainted: [], timer: null }));
    const msg = {
      type: "generate", id, prompt: opts.prompt ?? "", maxTokens: opts.maxTokens ?? 64,
      temperature: opts.temperature ?? 0, topP: opts.topP ?? 1, topK: opts.topK ?? -1, chat: !!opts.chat,
    };
    if (opts.seed != null) msg.seed = opts.seed;     // no seed: leave the field out (engines pick one)
    if (opts.messages) msg.messages = opts.messages;  // multi-turn chat: the whole conversation
    if (this.name === "python") {
      if (opts.jsonSchema != null) msg.jsonSchema = opts.jsonSchema;  // S15 JSON mode
      msg.speculative = !!opts.speculative;                           // S14, per request
      if (opts.live) { msg.live = true; livePanel.start(id, opts); }
    }
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

function sourceLinks() {
  // Captions name the chapter and the file implementing it; linked when config.js says where sources live.
  for (const a of document.querySelectorAll("a.caption[data-src]")) {
    a.title = a.dataset.src;
    a.insertAdjacentHTML("beforeend", ` — <code>${a.dataset.src}</code>`);
    if (cfg.sourceBase) a.href = new URL(a.dataset.src, new URL(cfg.sourceBase, location.href)).href;
  }
}

// ---- latency plot: one line per engine, x = token index, y = ms (no libraries) ----
const plot = {
  series: { python: [], ts: [] },
  pending: false,
  reset(name) { this.series[name] = []; this.draw(); },
  add(name, ...ms) {
    this.series[name].push(...ms);
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

// ---- the live panel: the Python engine's snapshot after every step ----
const OWNER_COLORS = ["#3572A5", "#2e9d5b", "#b04fb0", "#c7512d", "#7a6f1d", "#1d7a78"];
const livePanel = {
  last: null,          // latest live message
  current: null,       // request id whose figures "this request" shows
  jsonOn: false,
  reused: {},          // request id -> prompt tokens reused from the prefix cache
  colors: {},
  pending: false,
  color(rid) {
    if (!(rid in this.colors)) this.colors[rid] = OWNER_COLORS[Object.keys(this.colors).length % OWNER_COLORS.length];
    return this.colors[rid];
  },
  start(rid, opts) {
    this.current = rid;
    this.cost = { steps: 0, liveMs: 0, stepMs: 0 };
    this.jsonOn = opts.jsonSchema != null;
    this.spec = !!opts.speculative;
    $("prefix-this").textContent = "this request: waiting for its first step…";
    $("prefix-this").dataset.reused = "";
    $("grammar-stats").textContent = this.jsonOn ? "JSON mode on: waiting for the first step…" : "JSON mode off";
    $("grammar-stats").dataset.size = "";
    $("spec-stats").textContent = this.spec ? "on (n-gram, up to 4 drafts a step)" : "off for this request";
  },
  cost: { steps: 0, liveMs: 0, stepMs: 0 },   // the snapshots' own cost in the worker, since start()
  update(msg) {
    this.last = msg;
    if (msg.liveMs != null) {
      this.cost.steps++; this.cost.liveMs += msg.liveMs; this.cost.stepMs += msg.stepWallMs;
    }
    // Drawing waits for the next frame; at most one draw per frame, however many steps arrived.
    if (!this.pending) { this.pending = true; requestAnimationFrame(() => { this.pending = false; this.draw(); }); }
  },
  done(msg) {
    if (msg.cachedTokens != null) this.reused[msg.id] = msg.cachedTokens;
    if (msg.id === this.current) this.showReuse(msg.cachedTokens, msg.promptTokens);
    if (msg.id === this.current && this.spec) this.showSpec(msg.numDraftTokens, msg.numAcceptedTokens, true);
  },
  showReuse(reused, prompt) {
    const el = $("prefix-this");
    el.dataset.reused = String(reused);
    el.textContent = `this request: ${reused} of ${prompt} prompt tokens reused from the prefix cache` +
      (reused ? ` (${reused / (this.last ? this.last.blockSize : 16)} blocks, not recomputed)` : "");
  },
  showSpec(drafted, accepted, final) {
    const el = $("spec-stats");
    el.dataset.drafted = String(drafted);
    el.dataset.accepted = String(accepted);
    const rate = drafted ? ((100 * accepted) / drafted).toFixed(0) + "%" : "—";
    el.textContent = `${final ? "this request" : "so far"}: ${drafted} drafted, ${accepted} accepted, acceptance rate ${rate}`;
  },
  draw() {
    const m = this.last;
    if (!m) return;
    const grid = $("kv-blocks");
    if (grid.children.length !== m.blocks.length) {
      grid.textContent = "";
      for (let b = 0; b < m.blocks.length; b++) {
        const d = document.createElement("span");
        d.className = "kv-block";
        grid.appendChild(d);
      }
    }
    grid.dataset.step = String(m.step);      // which engine step the squares show
    const owner = {};
    for (const [rid, bl] of Object.entries(m.owners)) for (const b of bl) owner[b] = rid;
    m.blocks.forEach((state, b) => {
      const d = grid.children[b];
      d.dataset.state = String(state);
      d.dataset.owner = owner[b] || "";
      d.style.background = owner[b] ? this.color(owner[b]) : "";
      d.title = `block ${b}: ${["free", "in use", "in use, in the prefix cache", "free, holds a cached prefix"][state]}` +
        (owner[b] ? ` (${owner[b]})` : "");
    });
    $("kv-summary").textContent = `${m.usedBlocks} used, ${m.freeBlocks} free of ${m.totalBlocks} blocks ` +
      `(${m.blockSize} tokens each); ${m.cachedBlocks} hold a cached prefix`;
    $("kv-owners").innerHTML = Object.entries(m.owners).map(([rid, bl]) =>
      `<span class="owner"><span class="kv-block" style="background:${this.color(rid)}"></span>${rid}: ${bl.length} blocks</span>`).join(" ");
    $("sched-counts").textContent = `running ${m.running}, waiting ${m.waiting}`;
    $("mode-line").textContent = `weights ${m.mode === "lean" ? "lean (dequantized per layer per step)" : "resident (float32)"}` +
      `, KV cache ${m.kvCacheDtype}`;
    $("prefix-total").textContent = `engine total: ${m.prefixHitTokens} of ${m.prefixQueryTokens} looked-up prompt tokens were hits`;
    const r = m.requests[this.current];
    if (r && r.admitted) this.showReuse(r.cachedTokens, r.promptTokens);
    if (r && this.spec) this.showSpec(r.draftTokens, r.acceptedTokens, false);
    if (r && this.jsonOn && r.grammarMaskSize != null) {
      const el = $("grammar-stats");
      el.dataset.size = String(r.grammarMaskSize);
      el.textContent = `next token: ${r.grammarMaskSize} of ${m.vocabSize} tokens allowed by the JSON grammar ` +
        `(${((100 * r.grammarMaskSize) / m.vocabSize).toFixed(2)}%)`;
    }
    const s = m.stepMs || {};
    const total = (s.plan || 0) + (s.forward || 0) + (s.sample || 0);
    if (total > 0 && m.stepWallMs > 0) {      // (a snapshot after a cancel has no step of its own)
      for (const part of ["plan", "forward", "sample"]) {
        $("step-bar").querySelector(`[data-part=${part}]`).style.flexGrow = String(s[part] / total);
      }
      $("step-stats").textContent = `plan ${s.plan.toFixed(1)} ms, forward ${s.forward.toFixed(1)} ms, ` +
        `sample ${s.sample.toFixed(1)} ms (worker step ${m.stepWallMs.toFixed(1)} ms)`;
    }
  },
  arena(info) {
    const regions = info.arena || [];
    const total = info.arenaBytes || regions.reduce((a, r) => Math.max(a, r.offset + r.bytes), 0);
    const mb = (n) => (n >= 1048576 ? `${(n / 1048576).toFixed(1)} MB` : `${(n / 1024).toFixed(1)} KB`);
    $("arena-map").innerHTML = regions.map((r, i) =>
      `<span class="region" data-name="${r.name}" style="left:${(100 * r.offset) / total}%;width:${Math.max(0.15, (100 * r.bytes) / total)}%;` +
      `background:${OWNER_COLORS[i % OWNER_COLORS.length]}" title="${r.name} (${r.kind}): ${mb(r.bytes)} at ${r.offset}"></span>`).join("");
    $("arena-list").textContent = `${mb(total)} in one ArrayBuffer, ${regions.length} regions: ` +
      [...regions].sort((a, b) => b.bytes - a.bytes).map((r) => `${r.name} ${mb(r.bytes)}`).join(", ");
  },
};

// ---- agreement badge: the first token where the two engines' ids differ ----
let lastAgreement = null;

function compareRuns(results, opts) {
  const a = results.python, b = results.ts;
  const mode = (opts.temperature ?? 0) > 0 ? `seeded (seed ${opts.seed}, temperature ${opts.temperature})` : "greedy";
  if (!a || !b) return { state: "alone", mode };
  const n = Math.min(a.tokenIds.length, b.tokenIds.length);
  let i = 0;
  while (i < n && a.tokenIds[i] === b.tokenIds[i]) i++;
  if (i === n && a.tokenIds.length === b.tokenIds.length) return { state: "identical", mode, count: n };
  if (i === n) return { state: "prefix", mode, count: n, longer: a.tokenIds.length > n ? "python" : "ts" };
  const tokenText = (name, k) => {
    const span = engines[name].role("output").querySelector(`span[data-i="${k}"]`);
    return span ? span.textContent : null;
  };
  return { state: "diverged", mode, index: i,
           tokens: { python: { id: a.tokenIds[i], text: tokenText("python", i) },
                     ts: { id: b.tokenIds[i], text: tokenText("ts", i) } } };
}

function showAgreement(cmp, stopped) {
  lastAgreement = cmp;
  const el = $("agreement");
  el.dataset.state = cmp.state;
  el.dataset.index = cmp.index ?? "";
  for (const e of Object.values(engines)) {
    for (const s of e.role("output").querySelectorAll("span.diverge")) s.classList.remove("diverge");
  }
  const q = (t) => (t.text == null ? "" : JSON.stringify(t.text));
  const note = stopped ? " (stopped early)" : "";
  if (cmp.state === "identical") el.textContent = `\u2713 identical: all ${cmp.count} tokens agree (${cmp.mode})${note}`;
  else if (cmp.state === "prefix") {
    el.textContent = `\u2713 the first ${cmp.count} tokens agree; ${ENGINES[cmp.longer].label} went on (${cmp.mode})${note}`;
  } else if (cmp.state === "diverged") {
    el.textContent = `\u2717 first divergence at token ${cmp.index}: Python ${q(cmp.tokens.python)} (id ${cmp.tokens.python.id})` +
      ` vs TypeScript ${q(cmp.tokens.ts)} (id ${cmp.tokens.ts.id}) (${cmp.mode})${note}`;
    for (const e of Object.values(engines)) {
      const span = e.role("output").querySelector(`span[data-i="${cmp.index}"]`);
      if (span) { span.classList.add("diverge"); span.title = `first divergence (token ${cmp.index}, id ${span.dataset.token})`; }
    }
  } else el.textContent = "only one engine ran: nothing to compare";
}

// ---- page-level state and controls ----
const engines = {};
const conversation = { python: [], ts: [] };     // each engine's chat history ({role, content})
let runNote = "";

function showError(message) {
  const el = $("error");
  el.textContent = message || "";
  el.hidden = !message;
}

function setNote(text) {
  runNote = text || "";
  $("run-note").textContent = runNote;
}

function updateButtons() {
  const anyUsable = Object.values(engines).some((e) => e.status === "ready" || e.status === "loading");
  const anyRunning = Object.values(engines).some((e) => e.running.size > 0) || running;
  $("generate").disabled = !anyUsable || anyRunning;
  $("stop").disabled = !anyRunning;
  $("generate").textContent = $("chat").checked ? "Send" : "Generate";
  $("clear-chat").hidden = !$("chat").checked;
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
    buffer = stored.buffer || stored.blob;   // a revisit: the stored model as a Blob, read by each worker
    storeStatus(stored);
  }
  else if (source instanceof ArrayBuffer) buffer = source;
  else if (source && typeof source.arrayBuffer === "function") { name = name || source.name; buffer = await source.arrayBuffer(); }
  else throw new Error("loadModel: expected a URL, an ArrayBuffer or a File");
  name = name || "model";
  const bytes = buffer instanceof Blob ? buffer.size : buffer.byteLength;
  $("model-label").textContent = `${name} (${(bytes / 1048576).toFixed(1)} MB): loading…`;
  const live = Object.values(engines).filter((e) => e.available);
  // Each worker gets its own copy; the last one takes the original by transfer (no copy). A Blob is shared.
  const blob = buffer instanceof Blob;
  const results = await Promise.allSettled(live.map((e, i) => blob ? e.loadModel(buffer, false)
    : e.loadModel(i === live.length - 1 ? buffer : buffer.slice(0), i === live.length - 1)));
  const out = {};
  const refused = {};
  live.forEach((e, i) => {
    if (results[i].status === "fulfilled") out[e.name] = results[i].value;
    else refused[e.name] = results[i].reason.message;
  });
  const ok = Object.keys(out), bad = Object.keys(refused);
  if (stored) storeStatus(await stored.storing, stored);
  if (!ok.length) {
    $("model-label").textContent = `${name}: not loaded`;
    const message = Object.values(refused).join("; ");
    showError(message);
    throw Object.assign(new Error(message), { refused });
  }
  // One engine refusing the file does not make it "not loaded": the other one serves it.
  $("model-label").textContent = bad.length
    ? `${name}: loaded by ${ok.map((k) => ENGINES[k].label).join(", ")}; ` +
      bad.map((k) => `${ENGINES[k].label} refused it (${refused[k].replace(/^\w+: /, "")})`).join("; ")
    : `${name}: loaded`;
  showError("");
  if (bad.length) out.refused = refused;
  // An engine that refused a model the other took sits it out (a model it kept would be a different one).
  for (const e of live) e.sittingOut = e.name in refused;
  for (const k of bad) {
    engines[k].showError(`${refused[k]} — this engine sits this model out`);
    engines[k].setStatus("sits this model out (refused it)");
  }
  setNote(aloneNote());
  updateButtons();
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
           jsonSchema: $("json-mode").checked ? $("json-schema").value : null,
           speculative: $("speculative").checked, live: $("live").checked, sideBySide: $("side-by-side").checked };
}

// Which engines a run uses and why an engine sits out (honest states).
function participants() {
  const use = [], out = {};
  for (const e of Object.values(engines)) {
    if (e.sittingOut && e.status !== "loading") out[e.name] = `refused the model (${e.load ? e.load.error : "?"})`;
    else if (e.status === "ready" || e.status === "loading") use.push(e);
    else if (e.status === "unavailable") out[e.name] = e.error || "unavailable";
    else if (e.load && !e.load.ok) out[e.name] = `refused the model: ${e.load.error}`;
    else out[e.name] = e.status === "starting" ? "still starting, no model" : "no model loaded";
  }
  return { use, out };
}

function aloneNote() {
  const { use, out } = participants();
  const other = Object.entries(out)[0];   // none when the page was asked for one engine (?engines=ts)
  if (use.length === 1 && other) {
    const [k, why] = other;
    return `${use[0].label} runs alone: ${ENGINES[k].label} ${why}.`;
  }
  return "";
}

let running = false;

async function run(opts) {
  const { use, out } = participants();
  if (!use.length) throw new Error("no engine has a model: load a GGUF file first");
  running = true;
  updateButtons();
  const results = {};
  const errors = [];
  try {
    const loading = use.filter((e) => e.status === "loading");
    if (loading.length) {
      setNote(`waiting for ${loading.map((e) => e.label).join(" and ")} to finish loading the model…`);
      await Promise.all(loading.map((e) => e.modelReady.catch(() => {})));
    }
    const ready = use.filter((e) => e.status === "ready");
    const alone = ready.length === 1 ? aloneNote() || `${ready[0].label} runs alone.` : "";
    const mode = opts.sideBySide ? "both engines at once: they compete for the CPU, so their tok/s are not comparable"
                                 : "one engine after the other, so each has the CPU to itself while timed";
    setNote(alone || `Running ${mode}.`);
    const one = async (e) => {
      try { results[e.name] = await e.generate(Object.assign({}, opts, opts[e.name] || {}, { live: e.name === "python" && opts.live })); }
      catch (err) { errors.push(err.message); }
    };
    if (opts.sideBySide) await Promise.all(ready.map(one));
    else for (const e of ready) { if (!stopRequested) await one(e); }
  } finally {
    running = false;
    updateButtons();
  }
  const stopped = Object.values(results).some((r) => r.finishReason === "abort");
  const cmp = compareRuns(results, opts);
  if (cmp.state !== "alone" || Object.keys(results).length) showAgreement(cmp, stopped);
  if (errors.length) showError(errors.join("; "));
  return { ...results, agreement: cmp, alone: Object.keys(out).length ? out : null, errors };
}

let stopRequested = false;

function renderHistory() {
  for (const e of Object.values(engines)) {
    const h = e.role("history");
    h.textContent = "";
    for (const m of conversation[e.name]) {
      const d = document.createElement("div");
      d.className = `turn ${m.role}`;
      d.textContent = m.content;
      h.appendChild(d);
    }
  }
}

async function chatTurn(text, opts) {
  if (!text.trim()) throw new Error("type a message first");
  const perEngine = {};
  for (const name of Object.keys(engines)) {
    perEngine[name] = { messages: [...conversation[name], { role: "user", content: text }] };
  }
  const result = await run(Object.assign({}, opts, { chat: true }, ...Object.keys(perEngine).map((k) =>
    ({ [k]: Object.assign({}, opts[k] || {}, perEngine[k]) }))));
  let kept = 0;
  for (const name of Object.keys(engines)) {
    const r = result[name];
    // A stopped (or failed) turn stays out of the history: the next turn starts from the last whole one.
    if (r && r.finishReason !== "abort") {
      conversation[name].push({ role: "user", content: text }, { role: "assistant", content: r.text });
      kept++;
    }
  }
  renderHistory();
  return Object.assign(result, { kept });
}

function clearChat() {
  conversation.python = [];
  conversation.ts = [];
  renderHistory();
  for (const e of Object.values(engines)) { e.role("output").textContent = ""; e.role("stats").textContent = ""; }
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
    stopRequested = false;
    const opts = sampling();
    if ($("chat").checked) {
      const text = opts.prompt;
      $("prompt").value = "";
      guarded(chatTurn(text, opts).then((r) => { if (!r.kept) $("prompt").value = text; }));
    } else guarded(run(opts));
  });
  $("stop").addEventListener("click", () => { stopRequested = true; Object.values(engines).forEach((e) => e.cancel()); });
  $("chat").addEventListener("change", updateButtons);
  $("clear-chat").addEventListener("click", clearChat);
  $("json-mode").addEventListener("change", () => { $("json-schema-row").hidden = !$("json-mode").checked; });
  sourceLinks();
  plot.draw();
  updateButtons();
  if (query.get("model")) guarded(loadModel(abs(query.get("model"))));
}

init();
window.pyengineDemo = {
  ready: Promise.resolve(),
  config: cfg,
  loadModel: (src, name) => loadModel(src, name),
  loads: () => Object.fromEntries(Object.entries(engines).map(([k, e]) => [k, e.load])),
  generate: (opts) => {
    const e = engines[opts.engine || "python"];
    if (!e) return Promise.reject(new Error(`unknown engine ${opts.engine}`));
    return e.generate(opts);
  },
  run: (opts) => { stopRequested = false; return run(opts || {}); },
  chat: (text, opts) => { stopRequested = false; return chatTurn(text, opts || {}); },
  clearChat,
  conversation: () => JSON.parse(JSON.stringify(conversation)),
  agreement: () => lastAgreement,
  live: () => livePanel.last,
  liveRequest: () => livePanel.current,                // the request id the panel's "this request" follows
  liveCost: () => Object.assign({}, livePanel.cost),   // {steps, liveMs, stepMs} of the latest live request
  cancel: (engine) => {
    if (!engine) stopRequested = true;
    (engine ? [engines[engine]] : Object.values(engines)).forEach((e) => e && e.cancel());
  },
  stats: (engine) => (engines[engine || "python"] ? engines[engine || "python"].stats() : Promise.resolve(null)),
  state: () => Object.fromEntries(Object.entries(engines).map(([k, e]) =>
    [k, { status: e.status, info: e.info, error: e.error, running: e.running.size, load: e.load }])),
};
