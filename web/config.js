// Page configuration. `pyengine web` serves its own /config.js (with the server's default model);
// scripts/build_static.py writes one into web/dist/. Edit a deployed copy to point `pyodide` at a CDN, e.g.
// "https://cdn.jsdelivr.net/pyodide/v0.28.3/full/" (the ?pyodide=<url> query parameter overrides it).
window.PYENGINE_CONFIG = window.PYENGINE_CONFIG || {
  defaultModel: null,          // URL of a GGUF the page offers ("use the server's default model")
  pyodide: null,               // base URL of pyodide.mjs; null = <vendor>/pyodide/
  vendor: "./vendor/",         // manifest.json, wheels
  tsWorker: "../ts-mini/dist/worker.js",
  sourceBase: "../",           // where the repository's files are (the live panel's captions link to them); null: no links
};
