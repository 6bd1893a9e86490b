"""Reasoning models (issue 32): `<think>...</think>` returned as `reasoning_content`, thinking switched off through
`chat_template_kwargs`, tools read from the answer. The model is scripted: a fake runner over SmolLM2's real
vocabulary whose logits always pick the next token of a fixed text, behind a Qwen3-style chat template (written
here: it renders `<think>\\n\\n</think>` into the generation prompt when `enable_thinking` is false, as Qwen3's does).
The server is driven with the official `openai` client and raw httpx."""
from __future__ import annotations

import httpx
import numpy as np
import openai
import pytest

from engine_fakes import FakeRunner
from pyengine.server.reasoning import ReasoningParser, ThinkSplitter

QWEN3_STYLE = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' and '</think>' in m.content -%}"
    "{{- '<|im_start|>assistant\\n' + m.content.split('</think>')[-1].lstrip('\\n') + '<|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}"
    "{%- endif -%}")
R1_STYLE = QWEN3_STYLE.replace("{{- '<|im_start|>assistant\\n' -}}", "{{- '<|im_start|>assistant\\n<think>\\n' -}}")

THOUGHT = "The user says hello. A short greeting back is right."
ANSWER = "Hello! How can I help you today?"


def scripted(tok, text: str):
    """logits_fn: after the prompt, always the next token of `text`, then <|im_end|>."""
    script = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
    vocab = tok.vocab_size

    def logits(context):
        ctx = list(np.asarray(context).tolist())
        k = max((k for k in range(len(script), 0, -1) if ctx[-k:] == script[:k]), default=0)
        out = np.full(vocab, -30.0, np.float32)
        out[script[min(k, len(script) - 1)]] = 30.0
        return out
    return logits


@pytest.fixture(scope="module")
def tokenizer():
    from pyengine.gguf.reader import GGUFFile
    from pyengine.model_files import default_model_path
    from pyengine.tokenizer import Tokenizer
    return Tokenizer.from_gguf(GGUFFile(default_model_path()))


def serve(tokenizer, template: str, text: str):
    import copy

    from pyengine.engine.llm_engine import LLMEngine
    from pyengine.server.app import create_app
    from pyengine.server.http_server import ServerThread
    tok = copy.copy(tokenizer)
    tok.chat_template = template
    runner = FakeRunner(num_blocks=256, block_size=16, logits_fn=scripted(tok, text), tokenizer=tok)
    engine = LLMEngine(runner=runner, max_model_len=1024, max_num_seqs=4, max_num_batched_tokens=512)
    return ServerThread(create_app(engine, model_id="qwen3-style"))


def srv_tokenizer_text(tok, ids) -> str:
    return tok.decode(ids)


def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60)


HI = [{"role": "user", "content": "Hi!"}]


def test_reasoning_split_streamed_and_not(tokenizer):
    with serve(tokenizer, QWEN3_STYLE, f"<think>\n{THOUGHT}\n</think>\n\n{ANSWER}") as srv:
        c = client(srv)
        r = c.chat.completions.create(model="qwen3-style", messages=HI, max_tokens=64, temperature=0)
        msg = r.choices[0].message
        assert msg.content == ANSWER and r.choices[0].finish_reason == "stop"
        assert msg.model_extra["reasoning_content"].strip() == THOUGHT
        reasoning = content = ""
        for chunk in c.chat.completions.create(model="qwen3-style", messages=HI, max_tokens=64, temperature=0,
                                               stream=True):
            if chunk.choices:
                d = chunk.choices[0].delta
                reasoning += (d.model_extra or {}).get("reasoning_content") or ""
                content += d.content or ""
        assert content == ANSWER and reasoning == msg.model_extra["reasoning_content"]
        off = c.chat.completions.create(model="qwen3-style", messages=HI, max_tokens=64, temperature=0,
                                        extra_body={"include_reasoning": False})
        assert off.choices[0].message.content == ANSWER and "reasoning_content" not in off.choices[0].message.model_extra
        cut = c.chat.completions.create(model="qwen3-style", messages=HI, max_tokens=6, temperature=0)
        assert cut.choices[0].finish_reason == "length" and not cut.choices[0].message.content   # still thinking
        assert cut.choices[0].message.model_extra["reasoning_content"]


def test_enable_thinking_false_renders_an_empty_block_and_answers_directly(tokenizer):
    with serve(tokenizer, QWEN3_STYLE, ANSWER) as srv:
        body = {"model": "qwen3-style", "messages": HI, "chat_template_kwargs": {"enable_thinking": False}}
        ids = httpx.post(srv.url + "/tokenize", json=body).json()["tokens"]
        assert srv_tokenizer_text(tokenizer, ids).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
        r = client(srv).chat.completions.create(model="qwen3-style", messages=HI, max_tokens=64, temperature=0,
                                                extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        assert r.choices[0].message.content == ANSWER
        assert "reasoning_content" not in r.choices[0].message.model_extra
        for bad in ({"chat_template": "x"}, {"bos_token": "x"}, {"enable_thinking": [1]}, ["enable_thinking"]):
            resp = httpx.post(srv.url + "/v1/chat/completions", json={**body, "chat_template_kwargs": bad})
            assert resp.status_code == 400 and resp.json()["error"]["param"] == "chat_template_kwargs", bad


def test_deepseek_r1_style_prompt_opens_the_thinking(tokenizer):
    with serve(tokenizer, R1_STYLE, f"{THOUGHT}\n</think>\n\n{ANSWER}") as srv:
        r = client(srv).chat.completions.create(model="qwen3-style", messages=HI, max_tokens=64, temperature=0)
        assert r.choices[0].message.content == ANSWER
        assert r.choices[0].message.model_extra["reasoning_content"].strip() == THOUGHT


def test_tools_read_the_answer_not_the_reasoning(tokenizer):
    call = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    with serve(tokenizer, QWEN3_STYLE, f"<think>\nThe user wants weather: call the tool.\n</think>\n\n{call}") as srv:
        c = client(srv)
        r = c.chat.completions.create(model="qwen3-style", messages=HI, max_tokens=64, temperature=0, tools=tools)
        assert r.choices[0].finish_reason == "tool_calls"
        assert r.choices[0].message.tool_calls[0].function.name == "get_weather"
        assert "weather" in r.choices[0].message.model_extra["reasoning_content"]
        chunks = list(c.chat.completions.create(model="qwen3-style", messages=HI, max_tokens=64, temperature=0,
                                                tools=tools, stream=True))
        assert any(ch.choices and ch.choices[0].delta.tool_calls for ch in chunks)
        assert any(ch.choices and (ch.choices[0].delta.model_extra or {}).get("reasoning_content") for ch in chunks)


@pytest.mark.parametrize("size", [1, 2, 3, 5])
def test_splitter_is_the_same_whatever_the_deltas(size):
    """A tag cut anywhere across deltas never leaks into either field."""
    p = ReasoningParser()
    text = f"  <think>\n{THOUGHT}\n</think>\n\n{ANSWER}"
    whole = p.split(text, False)
    for start in range(len(text)):
        pieces = [text[:start]] + [text[m:m + size] for m in range(start, len(text), size)]
        s = ThinkSplitter(p, False)
        r = a = ""
        for piece in pieces:
            dr, da = s.push(piece)
            r, a = r + dr, a + da
        dr, da = s.flush()
        assert (r + dr, a + da) == whole
    assert whole == (f"\n{THOUGHT}\n", ANSWER)
    assert p.split("no tags at all", False) == (None, "no tags at all")
    assert p.split("a <think> in the middle", False) == (None, "a <think> in the middle")
    assert p.split("<thin", False) == (None, "<thin")
    assert p.opens_in_prompt("<|im_start|>assistant\n<think>\n") and not p.opens_in_prompt("<think>\n\n</think>\n\n")
