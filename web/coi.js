// Cross-origin isolation shim (classic script, runs before app.js). When the page is not cross-origin isolated
// (a static host without COOP/COEP headers), register coi_sw.js, which adds the headers to every response of
// this site. A page is isolated from its first load under the worker's control, so the first visit still runs
// ts-mini on one thread and says so; `window.PYENGINE_COI` tells app.js/tests what happened:
//   "isolated" (headers present) | "shim-installed" (reload to use all cores) | "unavailable: <why>"
(function () {
  if (self.crossOriginIsolated) { window.PYENGINE_COI = "isolated"; return; }
  if (!window.isSecureContext || !("serviceWorker" in navigator)) {
    window.PYENGINE_COI = "unavailable: service workers need https or localhost";
    return;
  }
  window.PYENGINE_COI = "installing";
  navigator.serviceWorker.register(new URL("coi_sw.js", document.currentScript.src).href).then(
    (reg) => navigator.serviceWorker.ready.then(() => { window.PYENGINE_COI = "shim-installed"; return reg; }),
    (err) => { window.PYENGINE_COI = `unavailable: ${err && err.message ? err.message : err}`; });
})();
