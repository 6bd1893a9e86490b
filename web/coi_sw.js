// Cross-origin isolation for plain static hosts (the static build: scripts/build_static.py). A host that cannot
// send COOP/COEP headers (GitHub Pages, python -m http.server, ...) gets them from this service worker, which
// re-serves every same-scope response with them; once it controls the page, the page is cross-origin isolated
// and ts-mini can share memory between its matmul threads. Registered by coi.js; `pyengine web` sends the
// headers itself, so there it is never needed.
const ISOLATION = {
  "Cross-Origin-Opener-Policy": "same-origin",
  "Cross-Origin-Embedder-Policy": "require-corp",
  "Cross-Origin-Resource-Policy": "cross-origin",
};

self.addEventListener("install", () => self.skipWaiting());
self.addEventListener("activate", (event) => event.waitUntil(self.clients.claim()));

self.addEventListener("fetch", (event) => {
  const req = event.request;
  if (req.cache === "only-if-cached" && req.mode !== "same-origin") return; // a devtools quirk: leave it alone
  event.respondWith((async () => {
    const resp = await fetch(req);
    if (resp.status === 0 || resp.type === "opaque" || resp.type === "opaqueredirect") return resp;
    const headers = new Headers(resp.headers);
    for (const [k, v] of Object.entries(ISOLATION)) headers.set(k, v);
    return new Response(resp.body, { status: resp.status, statusText: resp.statusText, headers });
  })());
});
