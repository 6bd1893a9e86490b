"""Issue 30 in the browser runtime: Qwen3's real tokenizer (NFC, the qwen2 split, 151k merges) and its chat template
with tools and enable_thinking -- from a GGUF's bytes inside Pyodide under Node (no jinja2 there) -- give the ids and
the text CPython gives (which tests/test_tokenizer_families.py and tests/test_chat_families.py check against HF
tokenizers and jinja2). Pyodide runs Python 3.13, whose Unicode tables are newer than CPython 3.11's."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from pyodide_harness import harness
from pyengine.tokenizer import Tokenizer
from test_chat_families import A, CALL, T, U, WEATHER, S
from test_tokenizer_families import TEXTS
from tokenizer_families import gpt2_metadata, write_gguf

pytestmark = [pytest.mark.pyodide, pytest.mark.slow]

CONVERSATIONS = [
    ([S("Réponds en français."), U("Quel temps à Zürich ? 🌦"), A("", tool_calls=[CALL]), T('{"temp": 21}')],
     {"tools": [WEATHER], "enable_thinking": False}),
    ([U("q1"), A("a1", reasoning_content="r1"), U("cafe\u0301 <|im_end|> typed")], {}),
    ([U("<think>x</think> 12345")], {"enable_thinking": True}),
]

SNIPPET = r"""
import json, time
from pyengine import Tokenizer
ref = json.load(open('/work/ref.json'))
t0 = time.perf_counter()
tok = Tokenizer.from_gguf(MODEL_BYTES)
t1 = time.perf_counter()
bad = [t[:30] for t, ids in zip(ref['texts'], ref['ids']) if tok.encode(t) != ids]
for (conv, extra), (text, ids) in zip(ref['conversations'], ref['chats']):
    got = tok.encode_chat(conv, **extra)
    if list(got) != [text, ids]:
        bad.append(f"chat {conv[0]['content'][:20]!r}")
print(f"built in {t1 - t0:.2f}s, {len(ref['texts'])} texts and {len(ref['chats'])} chats in {time.perf_counter() - t1:.2f}s")
for b in bad:
    print('FAIL', b)
assert not bad, f"{len(bad)} differ from CPython"
"""


def test_qwen3_tokenizer_and_chat_in_pyodide(tmp_path):
    problem = harness.missing_setup()
    if problem:
        pytest.fail(problem)
    path = write_gguf(gpt2_metadata("tokenizer-qwen3", "qwen3", "qwen2"), tmp_path / "qwen3-tokenizer.gguf")
    tok = Tokenizer.from_gguf(str(path))
    ref = {"texts": TEXTS, "ids": [tok.encode(t) for t in TEXTS],
           "conversations": CONVERSATIONS, "chats": [list(tok.encode_chat(c, **e)) for c, e in CONVERSATIONS]}
    (tmp_path / "ref.json").write_text(json.dumps(ref, ensure_ascii=False), encoding="utf-8")
    report = harness.run_in_pyodide(SNIPPET, files={"/work/ref.json": tmp_path / "ref.json"}, model=str(path))
    print(report["stdout"], report["timings_ms"], f"wall {report['wall_s']}s")
    assert report["ok"], harness.describe(report)
    assert report["versions"]["python"].startswith("3.13") and "chats in" in report["stdout"]
