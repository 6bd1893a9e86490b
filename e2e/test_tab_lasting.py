"""Issue 29 in the browser (the TypeScript engine, `?engines=ts`, and both engines on a revisit): the dev server makes the page cross-origin
isolated, so ts-mini runs its products on N worker threads and still gives HF's greedy tokens; the model is
stored by content in the Cache API, so a reload with the model route blocked still generates ("from cache");
a storage quota failure leaves the model working from memory with a clear message."""
from __future__ import annotations

import pytest

pytestmark = [pytest.mark.e2e]

N = 8


def _page(browser, server, init_script=None, query="?engines=ts&threads=2"):
    context = browser.new_context()
    if init_script:
        context.add_init_script(init_script)
    page = context.new_page()
    page.set_default_timeout(240_000)
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(server + "/" + query)
    page.evaluate("() => window.pyengineDemo.ready")
    return context, page, errors


def _greedy(page, case, engine="ts"):
    r = page.evaluate("([e, p]) => window.pyengineDemo.generate({engine: e, prompt: p, maxTokens: %d, temperature: 0})"
                      % N, [engine, case["prompt"]])
    return r["tokenIds"]


def _france(golden):
    return next(c for c in golden["cases"] if c["prompt"].startswith("The capital of France"))


def test_threads_greedy_and_reload_from_store_with_model_blocked(browser, server, golden):
    context, page, errors = _page(browser, server)
    try:
        assert page.evaluate("() => self.crossOriginIsolated") is True
        info = page.evaluate("() => window.pyengineDemo.loadModel('./model/default.gguf')")["ts"]
        assert info["threads"] == 2 and info["threadNote"] is None, info
        case = _france(golden)
        assert _greedy(page, case) == case["greedy_ids"][:N]
        page.wait_for_function("() => /stored for next visit/.test(document.getElementById('store-status').textContent)")

        # next visit: the model route is unreachable; the page loads the stored copy and generates
        blocked = []
        page.route("**/model/default.gguf", lambda route: (blocked.append(route.request.url), route.abort()))
        page.reload()
        page.evaluate("() => window.pyengineDemo.ready")
        info = page.evaluate("() => window.pyengineDemo.loadModel('./model/default.gguf')")["ts"]
        assert blocked, "the page did not even try to revalidate the stored model"
        status = page.text_content("#store-status")
        assert status.startswith("from cache (") and "MB stored" in status, status
        assert _greedy(page, case) == case["greedy_ids"][:N]

        # forget: the store is emptied, the next load downloads again
        page.unroute("**/model/default.gguf")
        page.click("#forget-models")
        page.wait_for_function("() => /forgot 1 stored model/.test(document.getElementById('store-status').textContent)")
        assert page.evaluate("async () => (await caches.keys()).length") == 0
        assert not errors, errors
    finally:
        context.close()


def test_both_engines_load_a_stored_model_from_its_blob(browser, server, golden):
    """A revisit hands both workers the stored body as a Blob (no copy in the page): ts-mini reads it into its
    WebAssembly memory, the Pyodide worker into the bytes it parses; both then give HF's greedy tokens."""
    context, page, errors = _page(browser, server, query="?threads=1")
    try:
        page.evaluate("() => window.pyengineDemo.loadModel('./model/default.gguf')")
        page.wait_for_function("() => /stored for next visit/.test(document.getElementById('store-status').textContent)")
        page.route("**/model/default.gguf", lambda route: route.abort())
        page.reload()
        page.evaluate("() => window.pyengineDemo.ready")
        info = page.evaluate("() => window.pyengineDemo.loadModel('./model/default.gguf')")
        assert set(info) == {"python", "ts"}, info
        assert page.text_content("#store-status").startswith("from cache (")
        case = _france(golden)
        for engine in ("ts", "python"):
            assert _greedy(page, case, engine) == case["greedy_ids"][:N], engine
        assert not errors, errors
    finally:
        context.close()


QUOTA = """
Cache.prototype.put = function () {
  return Promise.reject(new DOMException("simulated: quota exceeded", "QuotaExceededError"));
};
"""


def test_quota_failure_falls_back_to_memory(browser, server, golden):
    context, page, errors = _page(browser, server, init_script=QUOTA, query="?engines=ts&threads=1")
    try:
        info = page.evaluate("() => window.pyengineDemo.loadModel('./model/default.gguf')")["ts"]
        assert info["threads"] == 1
        status = page.text_content("#store-status")
        assert "quota" in status and "from memory" in status, status
        assert page.text_content("#model-label").endswith(": loaded")
        case = _france(golden)
        assert _greedy(page, case) == case["greedy_ids"][:N]
        assert page.evaluate("async () => (await caches.open('pyengine-models-v1').then((c) => c.keys())).length") == 0
        assert not errors, errors
    finally:
        context.close()


@pytest.fixture(scope="module")
def plain_static_site(tmp_path_factory, web_assets, model_path):
    """The static build (Pyodide runtime from the CDN stand-in: not needed by the TS engine) on http.server, which
    sends no COOP/COEP headers; the model is linked in at ./model/smol.gguf."""
    import os
    import subprocess
    import sys

    from e2e_support import ROOT, free_port, stop_process, wait_http
    out = tmp_path_factory.mktemp("coi") / "dist"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "build_static.py"), "--out", str(out),
                    "--pyodide", "https://cdn.invalid/pyodide/"], check=True, capture_output=True, text=True)
    (out / "model").mkdir()
    os.symlink(model_path, out / "model" / "smol.gguf")
    from pyengine.gguf import GGUFFile
    from pyengine.gguf.split import write_split
    parts = write_split(GGUFFile(model_path), str(out / "model" / "split"), max_tensors=100)
    os.makedirs(out / "broken")
    for p in parts[:2]:                                   # a split model whose third part is missing
        os.symlink(p, out / "broken" / os.path.basename(p))
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1",
                             "--directory", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_http(base + "/index.html", proc)
        yield base
    finally:
        stop_process(proc)


def test_static_build_gets_isolation_through_the_shim(browser, plain_static_site, golden):
    context = browser.new_context()
    page = context.new_page()
    page.set_default_timeout(240_000)
    try:
        resp = page.goto(plain_static_site + "/?engines=ts&threads=2")
        assert "cross-origin-embedder-policy" not in resp.headers       # the host does not send them
        assert page.evaluate("() => self.crossOriginIsolated") is False
        page.wait_for_function("() => window.PYENGINE_COI === 'shim-installed'")
        info = page.evaluate("() => window.pyengineDemo.loadModel('./model/smol.gguf')")["ts"]
        assert info["threads"] == 1 and "cross-origin isolated" in info["threadNote"]   # first visit: says so
        assert "reload the page to use all cores" in page.text_content("#engine-ts")
        page.reload()
        page.evaluate("() => window.pyengineDemo.ready")
        assert page.evaluate("() => self.crossOriginIsolated") is True
        assert page.evaluate("() => window.PYENGINE_COI") == "isolated"
        info = page.evaluate("() => window.pyengineDemo.loadModel('./model/smol.gguf')")["ts"]
        assert info["threads"] == 2, info
        case = _france(golden)
        assert _greedy(page, case) == case["greedy_ids"][:N]
    finally:
        context.close()


def test_split_gguf_loads_in_the_tab_and_a_missing_part_is_named(browser, plain_static_site, golden):
    context = browser.new_context()
    page = context.new_page()
    page.set_default_timeout(240_000)
    try:
        page.goto(plain_static_site + "/?engines=ts&threads=1")
        page.evaluate("() => window.pyengineDemo.ready")
        info = page.evaluate("() => window.pyengineDemo.loadModel('./model/split-00001-of-00003.gguf')")["ts"]
        assert info["layers"] == 30
        assert "(+2 parts)" in page.text_content("#model-label")
        case = _france(golden)
        assert _greedy(page, case) == case["greedy_ids"][:N]
        with pytest.raises(Exception, match="split-00003-of-00003.gguf: HTTP 404"):
            page.evaluate("() => window.pyengineDemo.loadModel('./broken/split-00001-of-00003.gguf')")
        assert _greedy(page, case) == case["greedy_ids"][:N]          # the loaded model still serves
    finally:
        context.close()
