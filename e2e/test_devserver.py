"""The dev server behind `pyengine web` (no browser): MIME types, Range requests on the model, config."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def client(model_path):
    from starlette.testclient import TestClient

    from pyengine.server.web import create_app
    with TestClient(create_app(model=model_path)) as c:
        yield c


def test_page_and_config(client):
    r = client.get("/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert 'src="app.js"' in r.text
    r = client.get("/config.js")
    assert r.headers["content-type"].startswith("text/javascript")
    cfg = json.loads(r.text.split("=", 1)[1].strip().rstrip(";"))
    assert cfg["defaultModel"] == "./model/default.gguf"


@pytest.mark.parametrize("path,mime", [("/app.js", "text/javascript"), ("/worker.js", "text/javascript"),
                                       ("/styles.css", "text/css"),
                                       ("/vendor/pyodide/pyodide.mjs", "text/javascript"),
                                       ("/vendor/pyodide/pyodide.asm.wasm", "application/wasm"),
                                       ("/vendor/manifest.json", "application/json")])
def test_mime_types(client, path, mime):
    if path.startswith("/vendor/") and not (ROOT / "web" / "vendor" / "manifest.json").is_file():
        pytest.fail("web/vendor not assembled: run scripts/setup_web.sh")
    r = client.get(path)
    assert r.status_code == 200, path
    assert r.headers["content-type"].split(";")[0] == mime


def test_model_range_requests(client, model_path):
    size = os.path.getsize(model_path)
    with open(model_path, "rb") as f:
        head = f.read(4096)
        f.seek(size - 100)
        tail = f.read()
    r = client.get("/model/default.gguf", headers={"Range": "bytes=0-4095"})
    assert r.status_code == 206
    assert r.headers["content-range"] == f"bytes 0-4095/{size}"
    assert r.content == head and r.content[:4] == b"GGUF"
    r = client.get("/model/default.gguf", headers={"Range": "bytes=-100"})
    assert r.status_code == 206 and r.content == tail
    r = client.get("/model/default.gguf", headers={"Range": f"bytes={size}-{size + 10}"})
    assert r.status_code == 416
    r = client.head("/model/default.gguf")
    assert r.status_code == 200 and int(r.headers["content-length"]) == size
    assert r.headers.get("accept-ranges") == "bytes"


def test_no_model_and_traversal():
    from starlette.testclient import TestClient

    from pyengine.server.web import create_app
    with TestClient(create_app(model=None)) as c:
        assert c.get("/model/default.gguf").status_code == 404
        cfg = c.get("/config.js").text
        assert '"defaultModel": null' in cfg
        assert c.get("/../pyproject.toml").status_code == 404
        assert c.get("/vendor/../../pyproject.toml").status_code == 404
    with pytest.raises(FileNotFoundError, match="model file not found"):
        create_app(model="/nonexistent.gguf")


def test_mountable_under_a_prefix(model_path):
    """The OpenAI server can serve the demo in the same process: Mount('/demo', app=create_app(...)).
    The page uses only relative URLs, so everything resolves under the prefix."""
    from starlette.applications import Starlette
    from starlette.routing import Mount
    from starlette.testclient import TestClient

    from pyengine.server.web import create_app
    outer = Starlette(routes=[Mount("/demo", app=create_app(model=model_path))])
    with TestClient(outer) as c:
        page = c.get("/demo/")
        assert page.status_code == 200 and 'src="app.js"' in page.text
        assert 'src="/' not in page.text and "href=\"/" not in page.text   # nothing absolute
        assert c.get("/demo/config.js").status_code == 200
        r = c.get("/demo/model/default.gguf", headers={"Range": "bytes=0-3"})
        assert r.status_code == 206 and r.content == b"GGUF"


def test_cross_origin_isolation_headers(client):
    for path in ("/", "/config.js", "/app.js", "/model/default.gguf"):
        r = client.head(path) if path.endswith(".gguf") else client.get(path)
        assert r.headers.get("cross-origin-opener-policy") == "same-origin", path
        assert r.headers.get("cross-origin-embedder-policy") == "require-corp", path
    assert client.get("/nonexistent.js").headers.get("cross-origin-embedder-policy") == "require-corp"


def test_model_etag_304_and_range_kept(client, model_path):
    r = client.head("/model/default.gguf")
    etag = r.headers["etag"]
    r = client.get("/model/default.gguf", headers={"If-None-Match": etag})
    assert r.status_code == 304 and r.content == b"" and r.headers["etag"] == etag
    r = client.get("/model/default.gguf", headers={"If-None-Match": f'"other", W/{etag}'})
    assert r.status_code == 304
    r = client.get("/model/default.gguf", headers={"If-None-Match": '"stale"', "Range": "bytes=0-3"})
    assert r.status_code == 206 and r.content == b"GGUF" and r.headers["etag"] == etag
