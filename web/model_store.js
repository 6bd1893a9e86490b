// The model lasts: each GGUF the page downloads is kept in the Cache API, keyed by its content (SHA-256 + size),
// and the next visit loads it from there with no download. Used by app.js (loadModel / "forget stored models").
//
//   fetchModel(url, onProgress) -> {buffer, blob, fromCache, storedBytes, storing, note}
//       stored copy + server says 304 (If-None-Match / If-Modified-Since), or the network fails: the stored copy
//       as a Blob (`blob`, `buffer` null; fromCache: true; no body is downloaded). Otherwise the download
//       (`buffer`, `blob` null), then stored: `storing` resolves to
//       {stored: true, bytes} or {stored: false, message} (quota exceeded, storage unavailable) — the model
//       works either way, from memory.
//   forgetAll() -> number of models removed;  storedModels() -> [{key, bytes, url}]
// Two kinds of entries in one cache: /__pyengine_models__/<sha256>-<size>.gguf (the bytes) and
// /__pyengine_models__/index?url=<model URL> (JSON {key, size, etag, lastModified}).

export const CACHE_NAME = "pyengine-models-v1";
const PREFIX = "/__pyengine_models__/";
const contentUrl = (key) => new URL(`${PREFIX}${key}.gguf`, location.origin).href;
const indexUrl = (url) => new URL(`${PREFIX}index?url=${encodeURIComponent(new URL(url, location.href).href)}`, location.origin).href;

function available() {
  return typeof caches !== "undefined" && typeof crypto !== "undefined" && !!crypto.subtle;
}

async function openStore() {
  return caches.open(CACHE_NAME);
}

async function readBody(resp, onProgress) {
  const total = Number(resp.headers.get("content-length")) || 0;
  const reader = resp.body.getReader();
  const chunks = [];
  let loaded = 0;
  for (;;) {
    const { done, value } = await reader.read();
    if (done) break;
    chunks.push(value);
    loaded += value.byteLength;
    if (onProgress) onProgress(loaded, total);
  }
  const out = new Uint8Array(loaded);
  let off = 0;
  for (const c of chunks) { out.set(c, off); off += c.byteLength; }
  return out.buffer;
}

function quotaMessage(err) {
  const quota = err && (err.name === "QuotaExceededError" || /quota/i.test(String(err.message)));
  return quota ? "not stored: the browser's storage quota is exceeded (the model runs from memory this visit)"
               : `not stored: ${err && err.message ? err.message : err} (the model runs from memory this visit)`;
}

async function lookup(url) {
  if (!available()) return null;
  try {
    const store = await openStore();
    const idx = await store.match(indexUrl(url));
    if (!idx) return null;
    const entry = await idx.json();
    const body = await store.match(contentUrl(entry.key));
    if (!body) return null;
    return { entry, body };
  } catch {
    return null;
  }
}

/** Keep `buffer` (downloaded from `url`, with its validators) in the store; resolves, never rejects. Everything
 * that reads `buffer` happens before this returns (the digest and the Response copy it), so the caller may
 * transfer `buffer` to a worker right away. */
function keep(url, buffer, resp) {
  if (!available()) return Promise.resolve({ stored: false, message: "not stored: this browser has no Cache API here (needs https or localhost)" });
  const size = buffer.byteLength;
  let digest, body;
  try {
    digest = crypto.subtle.digest("SHA-256", buffer);
    body = new Response(buffer, { headers: { "content-type": "application/octet-stream", "content-length": String(size) } });
  } catch (err) {
    return Promise.resolve({ stored: false, message: quotaMessage(err) });
  }
  const entry = { size, etag: resp.headers.get("etag"), lastModified: resp.headers.get("last-modified"), url };
  return (async () => {
    let key = null;
    try {
      const hex = Array.from(new Uint8Array(await digest), (b) => b.toString(16).padStart(2, "0")).join("");
      key = entry.key = `${hex}-${size}`;
      if (navigator.storage && navigator.storage.persist) await navigator.storage.persist().catch(() => false);
      const store = await openStore();
      await store.put(contentUrl(key), body);
      await store.put(indexUrl(url), new Response(JSON.stringify(entry), { headers: { "content-type": "application/json" } }));
      return { stored: true, bytes: size, key };
    } catch (err) {
      if (key) try { await (await openStore()).delete(contentUrl(key)); } catch { /* nothing to undo */ }
      return { stored: false, message: quotaMessage(err) };
    }
  })();
}

const SPLIT = /^(.*)-(\d{5})-of-(\d{5})\.gguf$/;

/** All part URLs of a split GGUF given its first part's URL (llama.cpp naming), else null. */
export function splitParts(url) {
  const u = new URL(url, location.href), m = SPLIT.exec(u.pathname);
  if (!m || Number(m[2]) !== 1) return null;
  return Array.from({ length: Number(m[3]) }, (_, i) => {
    const p = new URL(u.href);
    p.pathname = `${m[1]}-${String(i + 1).padStart(5, "0")}-of-${m[3]}.gguf`;
    return p.href;
  });
}

/**
 * fetchModel for a split GGUF: every part through the store (a missing part fails naming its URL), joined into
 * one GGUF by `join(buffers)` (ts-mini's joinSplit, which checks the parts). Same result shape as fetchModel.
 */
export async function fetchSplitModel(urls, onProgress, join) {
  const got = [];
  let done = 0;
  for (const u of urls) {
    const r = await fetchModel(u, (loaded, total) => onProgress && onProgress(done + loaded, 0));
    if (!r.buffer) r.buffer = await r.blob.arrayBuffer();   // the parts are joined here, in the page
    done += r.buffer.byteLength;
    got.push(r);
  }
  const buffer = join(got.map((r) => r.buffer));
  const storing = Promise.all(got.map((r) => r.storing)).then((all) => {
    const bad = all.find((s) => !s.stored);
    return bad || { stored: true, bytes: all.reduce((a, s) => a + s.bytes, 0) };
  });
  return { buffer, blob: null, fromCache: got.every((r) => r.fromCache), storedBytes: got.reduce((a, r) => a + r.storedBytes, 0),
           storing, note: got.map((r) => r.note).find(Boolean) || null, parts: urls.length };
}

export async function fetchModel(url, onProgress) {
  const hit = await lookup(url);
  if (hit) {
    const headers = {};
    if (hit.entry.etag) headers["If-None-Match"] = hit.entry.etag;
    if (hit.entry.lastModified) headers["If-Modified-Since"] = hit.entry.lastModified;
    let resp = null, note = null;
    try {
      resp = await fetch(url, { headers, cache: "no-store" });
    } catch (err) {
      note = "offline: used the stored copy";
    }
    if (resp && (resp.status === 304 || !resp.ok)) {
      if (!resp.ok && resp.status !== 304) note = `server answered HTTP ${resp.status}: used the stored copy`;
      if (resp.body) resp.body.cancel().catch(() => {});
      resp = null;
    }
    if (!resp) {
      // A handle on the stored bytes, not a copy: the engines' workers read it themselves (ts-mini straight into
      // its WebAssembly memory), so a revisit holds the model once and copies it once.
      const blob = await hit.body.blob().catch(() => null);
      if (blob && blob.size === hit.entry.size) {
        return { buffer: null, blob, fromCache: true, storedBytes: blob.size, storing: Promise.resolve({ stored: true, bytes: blob.size }), note };
      }
      note = "stored copy was damaged: downloaded again";
      resp = await fetch(url, { cache: "no-store" });
    }
    if (!resp.ok) throw new Error(`could not download ${url}: HTTP ${resp.status}`);
    const buffer = await readBody(resp, onProgress);
    return { buffer, blob: null, fromCache: false, storedBytes: 0, storing: keep(url, buffer, resp), note };
  }
  const resp = await fetch(url, { cache: "no-store" });
  if (!resp.ok) throw new Error(`could not download ${url}: HTTP ${resp.status}`);
  const buffer = await readBody(resp, onProgress);
  return { buffer, blob: null, fromCache: false, storedBytes: 0, storing: keep(url, buffer, resp), note: null };
}

export async function storedModels() {
  if (!available()) return [];
  const store = await openStore();
  const out = [];
  for (const req of await store.keys()) {
    if (!req.url.includes(`${PREFIX}index?`)) continue;
    const entry = await (await store.match(req)).json();
    out.push({ key: entry.key, bytes: entry.size, url: entry.url });
  }
  return out;
}

export async function forgetAll() {
  if (!available()) return 0;
  const n = (await storedModels()).length;
  await caches.delete(CACHE_NAME);
  return n;
}
