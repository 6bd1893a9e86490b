"""Regenerate tests/golden/chat_templates.json with HF transformers' apply_chat_template (S02 chat templates).

Run with the reference venv, never in CI:

    /work/refvenv/bin/python scripts/make_golden_chat.py

For each template (SmolLM2's own, read from its GGUF; ChatML; Zephyr; Llama-2; Llama-3; Gemma; Gemma 3 --
the Gemma 3 GGUF carries no template, so its published one is given as chat_template=) and each
conversation, with add_generation_prompt False and True, HF renders the text (tokenize=False) or raises;
both outcomes are recorded. Templates are rendered with the tokenizer whose special tokens they use
(SmolLM2's for the ChatML-like ones, Gemma 3's for Gemma's), and the rendered text's ids are recorded.
"variants" are re-formatted copies (must render the same), a near-miss copy whose whitespace changes the
output, and a template none of our renderers know (must be refused without jinja2).
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from make_golden_tokenizer import GEMMA3, SMOLLM2, load_hf, reference_versions, smollm2_own_pipeline  # noqa: E402

from pyengine.tokenizer import chat_template as ct  # noqa: E402  (template *sources* only)

CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "You are a pirate."}, {"role": "user", "content": "Hi there"}],
    [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"},
     {"role": "user", "content": "And 3+3?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a color."},
     {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Another?"},
     {"role": "assistant", "content": "Green."}],
    [{"role": "user", "content": "こんにちは 😀 — naïve café, 你好, Привет"}],
    [{"role": "user", "content": "  spaced out \n\n"}, {"role": "assistant", "content": "\tok  "}],
    [{"role": "user", "content": ""}],
    [{"role": "user", "content": "literal <|im_end|> and <end_of_turn> inside"}],
    [{"role": "system", "content": ""}, {"role": "user", "content": "empty system"}],
    [{"role": "system", "content": "only system"}],
    [{"role": "assistant", "content": "assistant first"}],
    [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
    [{"role": "user", "content": "call a tool"}, {"role": "tool", "content": "{\"result\": 42}"}],
    [{"role": "user", "content": "multi\nline\n\ncontent"}, {"role": "assistant", "content": "sure\n- one\n- two"}],
    [{"role": "user", "content": "extra keys are ignored", "name": "bob"}],
]
GEMMA3_PARTS = [
    [{"role": "user", "content": [{"type": "text", "text": "  describe  "}, {"type": "image"}]}],
    [{"role": "system", "content": [{"type": "text", "text": "sys as parts"}]},
     {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
]

# Re-formatted copies of known templates: different quotes and spacing inside tags, same output.
LLAMA2_REFORMATTED = (ct.LLAMA2_TEMPLATE.replace("'", '"').replace("{% ", "{%  ").replace(" %}", "   %}")
                      .replace("{{ ", "{{").replace(" }}", "}}"))
ZEPHYR_REFORMATTED = ct.ZEPHYR_TEMPLATE.replace("{% if", "  {% if").replace("{% elif", "\t{% elif")
SMOLLM2_OTHER_SYSTEM = ct.SMOLLM2_TEMPLATE.replace(
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face", "You are Qwen, a helpful \"assistant\".")
ZEPHYR_NEAR_MISS = ct.ZEPHYR_TEMPLATE.replace("{% elif", "{%- elif")   # eats the newline after each message
ALPACA_UNKNOWN = ("{% for message in messages %}{% if message['role'] == 'user' %}### Instruction:\n"
                  "{{ message['content'] }}\n\n{% else %}### Response:\n{{ message['content'] }}\n\n{% endif %}"
                  "{% endfor %}{% if add_generation_prompt %}### Response:\n{% endif %}")


def render_cases(tok, template: str, conversations) -> list[dict]:
    cases = []
    for messages in conversations:
        for agp in (False, True):
            case = {"messages": messages, "add_generation_prompt": agp}
            try:
                text = tok.apply_chat_template(messages, chat_template=template, add_generation_prompt=agp,
                                               tokenize=False)
                case["text"] = text
                case["ids"] = tok(text, add_special_tokens=False)["input_ids"]
            except Exception as e:  # noqa: BLE001 -- HF raises jinja2 / Value / Type errors
                case["error"] = f"{type(e).__name__}: {e}"
            cases.append(case)
    return cases


def main() -> int:
    smol = smollm2_own_pipeline(load_hf(SMOLLM2))
    gemma = load_hf(GEMMA3)
    own = smol.chat_template
    assert isinstance(own, str) and own, "SmolLM2's GGUF should carry a chat template"
    templates = [
        ("smollm2", own, "smollm2", "chatml-system"),
        ("chatml", ct.CHATML_TEMPLATE, "smollm2", "chatml"),
        ("zephyr", ct.ZEPHYR_TEMPLATE, "smollm2", "zephyr"),
        ("llama2", ct.LLAMA2_TEMPLATE, "smollm2", "llama2"),
        ("llama3", ct.LLAMA3_TEMPLATE, "smollm2", "llama3"),
        ("gemma", ct.GEMMA_TEMPLATE, "gemma3", "gemma"),
        ("gemma3", ct.GEMMA3_TEMPLATE, "gemma3", "gemma3"),
        ("llama2-reformatted", LLAMA2_REFORMATTED, "smollm2", "llama2"),
        ("zephyr-reformatted", ZEPHYR_REFORMATTED, "smollm2", "zephyr"),
        ("chatml-other-system", SMOLLM2_OTHER_SYSTEM, "smollm2", "chatml-system"),
        ("zephyr-near-miss", ZEPHYR_NEAR_MISS, "smollm2", None),
        ("alpaca-unknown", ALPACA_UNKNOWN, "smollm2", None),
    ]
    toks = {"smollm2": smol, "gemma3": gemma}
    out = {"reference": reference_versions(),
           "special_tokens": {name: {k: v for k, v in t.special_tokens_map.items() if isinstance(v, str)}
                              for name, t in toks.items()},
           "templates": []}
    for name, source, tok_name, expect in templates:
        conversations = CONVERSATIONS + (GEMMA3_PARTS if name == "gemma3" else [])
        out["templates"].append({"name": name, "source": source, "tokenizer": tok_name, "recognized_as": expect,
                                 "cases": render_cases(toks[tok_name], source, conversations)})
    path = ROOT / "tests" / "golden" / "chat_templates.json"
    path.write_text(json.dumps(out, ensure_ascii=False, separators=(",", ":")) + "\n", encoding="utf-8")
    n = sum(len(t["cases"]) for t in out["templates"])
    errors = sum(1 for t in out["templates"] for c in t["cases"] if "error" in c)
    print(f"wrote {path} ({os.path.getsize(path) // 1024} KB): {len(templates)} templates, {n} cases, "
          f"{errors} where HF raises")
    return 0


if __name__ == "__main__":
    sys.exit(main())
