// Run a Python snippet inside Pyodide (under Node), against the unchanged pyengine wheel.
//
//   node tests/pyodide/run.mjs --snippet FILE [--file SRC=DEST ...] [--model GGUF] [--vendor web/vendor]
//
// Boots Pyodide from web/vendor/pyodide (built by scripts/setup_web.sh), loads numpy + micropip (the
// vendored wheels, by name), installs the pyengine wheel with micropip (deps=False: numpy is already
// there), copies the given files into Pyodide's in-memory FS, and exposes the model to the snippet as `MODEL_BYTES` (Python bytes,
// the way the browser worker hands the engine an ArrayBuffer: the package never sees a host path).
// Prints one JSON line: {ok, stdout, stderr, error, timings_ms, versions}. Exit code 0 iff ok.
import fs from "node:fs";
import path from "node:path";
import { fileURLToPath, pathToFileURL } from "node:url";

const here = path.dirname(fileURLToPath(import.meta.url));
const args = { files: [], vendor: path.resolve(here, "../../web/vendor") };
for (let i = 2; i < process.argv.length; i++) {
  const a = process.argv[i];
  const next = () => process.argv[++i];
  if (a === "--snippet") args.snippet = next();
  else if (a === "--file") args.files.push(next());
  else if (a === "--model") args.model = next();
  else if (a === "--vendor") args.vendor = path.resolve(next());
  else { console.error(`run.mjs: unknown argument ${a}`); process.exit(2); }
}
if (!args.snippet) { console.error("run.mjs: --snippet FILE is required"); process.exit(2); }

const out = { ok: false, stdout: "", stderr: "", error: null, timings_ms: {}, versions: {} };
const t0 = performance.now();
const lap = (name) => { out.timings_ms[name] = Math.round(performance.now() - t0); };

try {
  const manifestPath = path.join(args.vendor, "manifest.json");
  if (!fs.existsSync(manifestPath)) throw new Error(`${manifestPath} missing: run scripts/setup_web.sh`);
  const manifest = JSON.parse(fs.readFileSync(manifestPath, "utf8"));
  const { loadPyodide } = await import(pathToFileURL(path.join(args.vendor, "pyodide", "pyodide.mjs")).href);
  const py = await loadPyodide({
    indexURL: path.join(args.vendor, "pyodide") + path.sep,
    stdout: (s) => { out.stdout += s + "\n"; },
    stderr: (s) => { out.stderr += s + "\n"; },
  });
  lap("boot");
  // By name from the vendored lock file (setup_web.sh points it at the numpy/micropip wheels it ships).
  await py.loadPackage(["numpy", "micropip"], { messageCallback: () => {} });
  lap("packages");
  const wheelName = path.basename(manifest.pyengine);
  py.FS.mkdirTree("/wheels");
  py.FS.writeFile(`/wheels/${wheelName}`, fs.readFileSync(path.join(args.vendor, manifest.pyengine)));
  await py.runPythonAsync(`
import micropip
await micropip.install("emfs:/wheels/${wheelName}", deps=False)
`);
  lap("install");
  for (const spec of args.files) {
    const [src, dest] = spec.split("=");
    py.FS.mkdirTree(path.posix.dirname(dest));
    py.FS.writeFile(dest, fs.readFileSync(src));
  }
  if (args.model) {
    // One copy into the wasm heap as Python bytes, exactly what the browser worker does with its ArrayBuffer.
    const buf = fs.readFileSync(args.model);
    const u8 = new Uint8Array(buf.buffer, buf.byteOffset, buf.byteLength);
    py.globals.set("_model_js", u8);
    py.runPython("MODEL_BYTES = _model_js.to_bytes(); del _model_js");
    lap("model");
  }
  out.versions = py.runPython(
    "import sys, numpy, pyengine; import json; json.dumps({'python': sys.version.split()[0], " +
    "'numpy': numpy.__version__, 'pyengine': pyengine.__version__})");
  out.versions = JSON.parse(out.versions);
  await py.runPythonAsync(fs.readFileSync(args.snippet, "utf8"));
  lap("run");
  // the wasm heap only grows: its size now is the run's peak
  out.wasm_memory_mb = Math.round(py._module.HEAPU8.buffer.byteLength / 2 ** 20);
  out.ok = true;
} catch (err) {
  out.error = String(err && err.message ? err.message : err);
}
out.timings_ms.total = Math.round(performance.now() - t0);
process.stdout.write(JSON.stringify(out) + "\n");
process.exit(out.ok ? 0 : 1);
