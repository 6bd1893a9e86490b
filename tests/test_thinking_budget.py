"""Issue 32: the thinking-token budget (item 2) and the sampling / scheduling fields on the server (item 5).

The model is scripted over SmolLM2's real vocabulary behind a Qwen3-style chat template (test_reasoning.py's): a
"long thinker" that opens `<think>` and would think forever, and answers once the context holds `</think>`. With
``thinking_token_budget`` B the engine must leave it exactly B tokens after the tag, force `</think>\\n\\n` as the
tokenizer encodes it, and the answer follows. The server is driven with the official `openai` client
(``extra_body``) and raw httpx for the 400s."""
from __future__ import annotations

import copy

import httpx
import numpy as np
import openai
import pytest

from engine_fakes import FakeRunner
from test_reasoning import ANSWER, HI, QWEN3_STYLE, R1_STYLE

THOUGHT = "Let me think about this once more. " * 40


@pytest.fixture(scope="module")
def tokenizer():
    from pyengine.gguf.reader import GGUFFile
    from pyengine.model_files import default_model_path
    from pyengine.tokenizer import Tokenizer
    return Tokenizer.from_gguf(GGUFFile(default_model_path()))


def thinker(tok, opens: bool):
    """logits_fn: after the last `<|im_start|>`, the next token of `<think>\\n` + an endless thought, or, once the
    output holds `</think>`, the next token of the answer, then <|im_end|>."""
    start = tok.token_to_id("<|im_start|>")
    think = tok.encode(("" if opens else "<think>\n") + THOUGHT, add_special_tokens=False)
    answer = tok.encode(ANSWER, add_special_tokens=False) + [tok.eos_token_id]
    prompt_tail = len(tok.encode("assistant\n" + ("<think>\n" if opens else ""), add_special_tokens=False))

    def logits(context):
        ctx = np.asarray(context).tolist()
        out = np.full(tok.vocab_size, -30.0, np.float32)
        if start not in ctx:                       # a plain completion prompt: end at once
            out[tok.eos_token_id] = 30.0
            return out
        gen = ctx[len(ctx) - ctx[::-1].index(start) + prompt_tail:]
        text = tok.decode(gen)
        if "</think>" in text:
            k = max((k for k in range(len(answer), 0, -1) if gen[-k:] == answer[:k]), default=0)
            nxt = answer[min(k, len(answer) - 1)]
        else:
            nxt = think[len(gen)]
        out[nxt] = 30.0
        return out
    return logits, think, answer


def engine(tok, template, opens=False, **kw):
    from pyengine.engine.llm_engine import LLMEngine
    tok = copy.copy(tok)
    tok.chat_template = template
    fn, think, answer = thinker(tok, opens)
    runner = FakeRunner(num_blocks=256, block_size=16, logits_fn=fn, tokenizer=tok)
    return LLMEngine(runner=runner, max_model_len=1024, max_num_seqs=4, max_num_batched_tokens=512, **kw), \
        think, answer, tok


@pytest.mark.parametrize("budget", [0, 1, 7])
def test_budget_leaves_b_thought_tokens_then_forces_the_close(tokenizer, budget):
    from engine_fakes import run_all
    from pyengine.sampling_params import SamplingParams
    eng, think, answer, tok = engine(tokenizer, QWEN3_STYLE)
    _, prompt = tok.encode_chat(HI)
    # the tag is complete after m tokens (read on text, not on the engine's byte state)
    m = next(m for m in range(1, len(think)) if tok.decode(think[:m]).lstrip().startswith("<think>"))
    close = tok.encode("</think>\n\n", add_special_tokens=False)
    eng.add_request("r", {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=200,
                                                                     thinking_token_budget=budget))
    eng.add_request("free", {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=60))
    out = run_all(eng)
    assert out["r"].outputs[0].token_ids == think[:m + budget] + close + answer
    assert out["free"].outputs[0].token_ids == think[:60]          # the request beside it thinks on
    # a thought closed by the model inside its budget is left alone
    eng2, *_ = engine(tokenizer, QWEN3_STYLE)
    eng2.add_request("r", {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=200,
                                                                      thinking_token_budget=10_000))
    assert "</think>" not in run_all(eng2)["r"].outputs[0].text


def test_budget_holds_under_speculation(tokenizer):
    """The thought repeats itself, so n-gram drafts run through the point where the budget forces the close: the
    verification rows apply it after the drafts before them, and the tokens are those of plain decoding."""
    from engine_fakes import run_all
    from pyengine.sampling_params import SamplingParams
    got = []
    for spec in (None, {"method": "ngram", "num_speculative_tokens": 5, "adaptive": False}):
        eng, think, answer, tok = engine(tokenizer, QWEN3_STYLE, speculative_config=spec)
        _, prompt = tok.encode_chat(HI)
        for i, budget in enumerate((20, 33)):
            eng.add_request(f"r{i}", {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=120,
                                                                                 thinking_token_budget=budget))
        got.append({k: v.outputs[0].token_ids for k, v in run_all(eng).items()})
        if spec is not None:
            assert eng.stats()["spec_decode_num_accepted_tokens"] > 20
    assert got[0] == got[1]
    assert all(ids[-len(answer):] == answer for ids in got[0].values())


def test_budget_through_the_openai_client(tokenizer):
    from pyengine.server.app import create_app
    from pyengine.server.http_server import ServerThread
    for template, opens in ((QWEN3_STYLE, False), (R1_STYLE, True)):
        eng, think, answer, tok = engine(tokenizer, template, opens)
        with ServerThread(create_app(eng, model_id="qwen3-style")) as srv:
            c = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60)
            lead = 0 if opens else next(m for m in range(1, len(think))
                                        if tok.decode(think[:m]).lstrip().startswith("<think>"))
            r = c.chat.completions.create(model="qwen3-style", messages=HI, max_tokens=300, temperature=0,
                                          extra_body={"thinking_token_budget": 12})
            msg = r.choices[0].message
            assert msg.content == ANSWER and r.choices[0].finish_reason == "stop"
            assert msg.model_extra["reasoning_content"].strip() == tok.decode(think[lead:lead + 12]).strip()
            reasoning = content = ""
            for chunk in c.chat.completions.create(model="qwen3-style", messages=HI, max_tokens=300, temperature=0,
                                                   stream=True, extra_body={"thinking_token_budget": 12}):
                if chunk.choices:
                    reasoning += (chunk.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
                    content += chunk.choices[0].delta.content or ""
            assert content == ANSWER and reasoning == msg.model_extra["reasoning_content"]
            close = tok.encode("</think>\n\n", add_special_tokens=False)
            for budget in (0, 12):           # usage counts the thought's tokens, the tags' not (vLLM's rule)
                resp = c.responses.create(model="qwen3-style", input="Hi!", max_output_tokens=300, temperature=0,
                                          extra_body={"thinking_token_budget": budget})
                assert resp.output_text == ANSWER
                assert resp.usage.output_tokens_details.reasoning_tokens == budget
                assert resp.usage.output_tokens == lead + budget + len(close) + len(answer)
            with c.responses.stream(model="qwen3-style", input="Hi!", max_output_tokens=300, temperature=0,
                                    extra_body={"thinking_token_budget": 5}) as events:
                final = events.get_final_response()
            assert final.output_text == ANSWER and final.usage.output_tokens_details.reasoning_tokens == 5
            unbounded = c.chat.completions.create(model="qwen3-style", messages=HI, max_tokens=40, temperature=0)
            assert unbounded.choices[0].finish_reason == "length" and not unbounded.choices[0].message.content


def test_fields_reach_the_engine_through_the_openai_client(tokenizer):
    from pyengine.server.app import create_app
    from pyengine.server.http_server import ServerThread
    eng, think, answer, tok = engine(tokenizer, QWEN3_STYLE)
    seen = []
    add = eng.add_request

    def spy(rid, prompt, params=None, priority=0, **kw):
        seen.append((params, priority))
        return add(rid, prompt, params, priority, **kw)
    eng.add_request = spy
    first_thought = tok.decode(think[:1])
    with ServerThread(create_app(eng, model_id="qwen3-style")) as srv:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60)
        r = c.chat.completions.create(model="qwen3-style", messages=HI, max_tokens=8, temperature=0, extra_body={
            "min_tokens": 3, "bad_words": [first_thought], "allowed_token_ids": list(range(5000)), "priority": -7})
        params, priority = seen[-1]
        assert priority == -7 and params.min_tokens == 3 and params.bad_words == [first_thought]
        assert params.allowed_token_ids == list(range(5000))
        ids = tok.encode(r.choices[0].message.content or "", add_special_tokens=False)
        assert think[0] not in ids and all(t < 5000 for t in ids)
        c.completions.create(model="qwen3-style", prompt="Hi", max_tokens=4, extra_body={"priority": 3})
        assert seen[-1][1] == 3
        c.responses.create(model="qwen3-style", input="Hi", max_output_tokens=4, extra_body={"priority": 2,
                                                                                              "min_tokens": 2})
        assert seen[-1][1] == 2 and seen[-1][0].min_tokens == 2
        url = srv.url + "/v1/chat/completions"
        base = {"model": "qwen3-style", "messages": HI, "max_tokens": 8}
        for field, value in (("min_tokens", -1), ("min_tokens", "3"), ("min_tokens", 9), ("bad_words", [1]),
                             ("bad_words", [" "]), ("bad_words", {"a": 1}), ("allowed_token_ids", []),
                             ("allowed_token_ids", [tok.vocab_size]), ("allowed_token_ids", [-1]),
                             ("allowed_token_ids", "1,2"), ("priority", 1.5), ("priority", 10 ** 6),
                             ("priority", True), ("thinking_token_budget", -1), ("thinking_token_budget", "x")):
            resp = httpx.post(url, json={**base, field: value})
            err = resp.json()["error"]
            assert resp.status_code == 400 and err["param"] == field and field in err["message"], (field, value, err)
        resp = httpx.post(url, json={**base, "max_tokens": None, "min_tokens": 2000})     # beyond the context
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "min_tokens"
        n = len(seen)
        with pytest.raises(openai.BadRequestError) as exc:
            c.completions.create(model="qwen3-style", prompt="Hi", max_tokens=4, extra_body={"min_tokens": 5})
        assert exc.value.body["param"] == "min_tokens" and len(seen) == n


def test_a_model_without_thinking_refuses_the_budget(tokenizer):
    from pyengine.server.app import create_app
    from pyengine.server.http_server import ServerThread
    eng, *_ = engine(tokenizer, "{% for m in messages %}{{ m.content }}{% endfor %}")
    with ServerThread(create_app(eng, model_id="plain")) as srv:
        resp = httpx.post(srv.url + "/v1/chat/completions", json={"model": "plain", "messages": HI, "max_tokens": 4,
                                                                  "thinking_token_budget": 5})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "thinking_token_budget"
        ok = httpx.post(srv.url + "/v1/chat/completions", json={"model": "plain", "messages": HI, "max_tokens": 4})
        assert ok.status_code == 200
