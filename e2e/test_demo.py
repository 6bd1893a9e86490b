"""S22 end to end: the demo page in headless Chromium, both engines in their web workers.

Greedy generation from the Python (Pyodide) and TypeScript engines must give identical token ids, equal to
HF transformers' greedy tokens (tests/golden/generation_smollm2.json); cancel stops a generation; a corrupt
file shows a readable error and the page keeps generating afterwards.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "pyodide"))  # golden_checks

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

N_TOKENS = 32
N_PROMPTS = 3
# Both engines by default; PYENGINE_E2E_ENGINES=python narrows a local debugging run.
ENGINES = tuple(os.environ.get("PYENGINE_E2E_ENGINES", "python,ts").split(","))


def _js(page, script: str, arg=None):
    return page.evaluate(script, arg)


@pytest.fixture(scope="module")
def loaded(demo):
    """The demo page with the server's default model loaded into both engines (load time recorded)."""
    page, log = demo
    t0 = time.perf_counter()
    try:
        infos = _js(page, "() => window.pyengineDemo.loadModel('./model/default.gguf')")
    except Exception as exc:
        pytest.fail(f"loading the default model failed: {exc}\n{log}")
    infos["_wall_s"] = round(time.perf_counter() - t0, 1)
    print("model loaded:", infos)
    return page, log, infos


def test_page_boots_pyodide_and_lists_engines(demo):
    page, log = demo
    assert "pyengine" in page.title()
    # The Pyodide worker reports its runtime (Pyodide + numpy + the pyengine wheel) without any model.
    page.wait_for_function("() => window.pyengineDemo.state().python.status !== 'starting'", timeout=180_000)
    state = _js(page, "() => window.pyengineDemo.state()")
    assert state["python"]["status"] in ("idle", "loading", "ready"), state
    assert not log.errors(), str(log)


def test_both_engines_load_the_model(loaded):
    page, log, infos = loaded
    for name in ENGINES:
        assert name in infos, f"{name} engine did not load: {_js(page, '() => window.pyengineDemo.state()')}"
    assert infos["python"]["layers"] == 30
    assert infos["python"]["wasmBytes"] > 98_000_000        # the GGUF bytes live in the wasm heap


def test_greedy_tokens_match_each_other_and_golden(loaded, golden):
    page, log, _ = loaded
    from golden_checks import cases_without_stops, check_greedy

    stops = _js(page, "() => window.pyengineDemo.state().python.info.stopTokenIds")
    cases = cases_without_stops(golden, N_TOKENS, stops, N_PROMPTS)
    assert len(cases) == N_PROMPTS
    report = []
    for case in cases:
        # Both engines at once (each in its own worker thread), as the page's Generate button does.
        results = _js(page, """async ([engines, prompt, n]) => {
            const runs = engines.map((engine) =>
                window.pyengineDemo.generate({engine, prompt, maxTokens: n, temperature: 0, seed: 0}));
            const out = await Promise.all(runs);
            return Object.fromEntries(engines.map((e, i) => [e, out[i]]));
        }""", [list(ENGINES), case["prompt"], N_TOKENS])
        for name in ENGINES:
            report.append((name, case["prompt"][:20], round(results[name]["tokensPerSecond"], 2)))
        for name in ENGINES:
            got = results[name]["tokenIds"]
            assert len(got) == N_TOKENS, (name, results[name])
            assert not check_greedy(got, case, N_TOKENS), f"{name} engine: {check_greedy(got, case, N_TOKENS)}"
        for name in ENGINES[1:]:
            assert results[name]["tokenIds"] == results[ENGINES[0]]["tokenIds"]
            assert results[name]["text"] == results[ENGINES[0]]["text"]
    print("decode tok/s:", report)


def test_chat_template_toggle_matches_golden_chat_prompt(loaded, golden):
    """chat: true wraps the prompt in the model's chat template (SmolLM2 adds its default system turn):
    the result must be the golden ChatML case's greedy tokens, from both engines."""
    page, log, _ = loaded
    from golden_checks import check_greedy

    case = next(c for c in golden["cases"] if c["prompt"].startswith("<|im_start|>system"))
    user = case["prompt"].split("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]
    n = 8
    results = _js(page, """async ([engines, prompt, n]) => {
        const out = await Promise.all(engines.map((engine) =>
            window.pyengineDemo.generate({engine, prompt, maxTokens: n, temperature: 0, chat: true})));
        return Object.fromEntries(engines.map((e, i) => [e, out[i]]));
    }""", [list(ENGINES), user, n])
    for name in ENGINES:
        assert len(results[name]["tokenIds"]) == n, (name, results[name])
        assert not check_greedy(results[name]["tokenIds"], case, n), (name, results[name]["tokenIds"])


def test_cancel_stops_generation(loaded):
    page, log, _ = loaded
    for name in ENGINES:
        result = _js(page, """async (engine) => {
            const d = window.pyengineDemo;
            const p = d.generate({engine, prompt: 'Once upon a time', maxTokens: 500, temperature: 0});
            // cancel once a few tokens have streamed in
            while (d.state()[engine].running && document.querySelector(`#engine-${engine} [data-role=output]`)
                   .textContent.length < 8) await new Promise(r => setTimeout(r, 20));
            d.cancel(engine);
            const r = await p;
            return {n: r.tokenIds.length, finishReason: r.finishReason, running: d.state()[engine].running};
        }""", name)
        assert result["finishReason"] == "abort", (name, result)
        assert 1 <= result["n"] < 500, (name, result)
        assert result["running"] == 0


def test_corrupt_file_shows_error_and_page_keeps_working(loaded, server):
    page, log, _ = loaded
    # The first 64 KiB of the real file (fetched with a Range request): a valid header, truncated tensors.
    message = _js(page, """async () => {
        const r = await fetch('./model/default.gguf', {headers: {Range: 'bytes=0-65535'}});
        if (r.status !== 206) return 'no range support: ' + r.status;
        try { await window.pyengineDemo.loadModel(await r.arrayBuffer(), 'corrupt.gguf'); return 'loaded?!'; }
        catch (e) { return e.message; }
    }""")
    assert "GGUF" in message or "truncat" in message.lower() or "beyond" in message.lower(), message
    banner = page.inner_text("#error")
    assert banner.strip() and "Traceback" not in banner, banner
    assert page.is_visible("#error")
    # Garbage without the magic gets a readable error too.
    message2 = _js(page, """async () => {
        try { await window.pyengineDemo.loadModel(new Uint8Array(1000).fill(7).buffer, 'junk.gguf'); return 'loaded?!'; }
        catch (e) { return e.message; }
    }""")
    assert "magic" in message2.lower() or "GGUF" in message2, message2
    # Through the UI: the file picker with a junk file shows the error in the banner and per engine.
    page.evaluate("() => { document.querySelector('#error').hidden = true; }")
    page.set_input_files("#model-file", files=[{"name": "junk.gguf", "mimeType": "application/octet-stream",
                                                "buffer": b"NOPE" + bytes(4000)}])
    page.wait_for_selector("#error:not([hidden])", timeout=60_000)
    page.wait_for_function("() => window.pyengineDemo.state().python.status !== 'loading'", timeout=60_000)
    assert "magic" in page.inner_text("#engine-python [data-role=error]").lower()
    assert "junk.gguf: not loaded" in page.inner_text("#model-label")
    # The Python worker keeps its previous model when a load fails: it generates right away.
    r = _js(page, """async () => window.pyengineDemo.generate(
        {engine: 'python', prompt: 'The capital of France is', maxTokens: 4, temperature: 0})""")
    assert len(r["tokenIds"]) == 4, r
    # And the page as a whole keeps working: load the good model again, both engines generate.
    _js(page, "() => window.pyengineDemo.loadModel('./model/default.gguf')")
    assert page.is_hidden("#error")
    for name in ENGINES:
        r = _js(page, """async (engine) => window.pyengineDemo.generate(
            {engine, prompt: 'The capital of France is', maxTokens: 4, temperature: 0})""", name)
        assert len(r["tokenIds"]) == 4, (name, r)
    assert not log.errors(), str(log)


def test_json_toggle_constrains_the_python_engine(loaded):
    """S15 in the browser: the JSON toggle shows the schema box; a JSON Schema sent with generate makes the
    Pyodide engine's output valid against it (checked here with jsonschema) and the page says so."""
    import json

    import jsonschema
    page, log, _ = loaded
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"},
              "n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["ok", "n"]}
    assert page.is_hidden("#json-schema-row")
    page.check("#json-mode")
    assert page.is_visible("#json-schema-row")
    page.uncheck("#json-mode")
    result = _js(page, """async (schema) => window.pyengineDemo.generate(
        {engine: "python", prompt: "Answer in JSON:", maxTokens: 16, temperature: 0, jsonSchema: schema})""",
                 json.dumps(schema))
    assert result["finishReason"] == "stop" and result["json"] == "valid", (result, log)
    jsonschema.validate(json.loads(result["text"]), schema)
    assert "JSON valid" in page.text_content("#engine-python [data-role=stats]")
    # an empty schema: any JSON object (the pushdown matcher, recursive rules) in wasm32 too
    result = _js(page, """async () => window.pyengineDemo.generate(
        {engine: "python", prompt: "JSON:", maxTokens: 6, temperature: 0, jsonSchema: ""})""")
    assert result["text"].startswith("{") and result["json"] in ("valid", "incomplete"), (result, log)
