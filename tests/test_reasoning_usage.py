"""Issue 32 item 2: chat completions' ``usage.completion_tokens_details.reasoning_tokens``, non-streamed and in the
final usage chunk of a stream, read with the official `openai` client.

The model is scripted (a fake runner over SmolLM2's real vocabulary, test_reasoning.py's Qwen3- and R1-style
templates): its output is the concatenation of separately encoded pieces, `<think>`, the thought, `</think>`, the
answer, so the thought's token count is known by construction. The expected figure is vLLM's
(`BaseThinkingReasoningParser.count_reasoning_tokens`): the tokens between the tags, the tags not counted."""
from __future__ import annotations

import copy

import numpy as np
import openai
import pytest

from engine_fakes import FakeRunner
from test_reasoning import ANSWER, HI, QWEN3_STYLE, R1_STYLE, THOUGHT, tokenizer  # noqa: F401 (fixture)


def scripted_ids(script: list[int], vocab: int):
    """logits_fn: after the prompt, always the next token of `script` (which ends with the eos)."""
    def logits(context):
        ctx = np.asarray(context).tolist()
        k = max((k for k in range(len(script), 0, -1) if ctx[-k:] == script[:k]), default=0)
        out = np.full(vocab, -30.0, np.float32)
        out[script[min(k, len(script) - 1)]] = 30.0
        return out
    return logits


def server(tokenizer, template: str, pieces: list[str]):
    from pyengine.engine.llm_engine import LLMEngine
    from pyengine.server.app import create_app
    from pyengine.server.http_server import ServerThread
    tok = copy.copy(tokenizer)
    tok.chat_template = template
    script = [t for piece in pieces for t in tok.encode(piece, add_special_tokens=False)] + [tok.eos_token_id]
    runner = FakeRunner(num_blocks=256, block_size=16, logits_fn=scripted_ids(script, tok.vocab_size), tokenizer=tok)
    engine = LLMEngine(runner=runner, max_model_len=1024, max_num_seqs=4, max_num_batched_tokens=512)
    return ServerThread(create_app(engine, model_id="qwen3-style")), len(script)     # the eos is an output token


def usage_both_ways(srv, **kw):
    """(non-streamed usage, the usage of a stream's final chunk) of one chat request."""
    c = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60)
    full = c.chat.completions.create(model="qwen3-style", messages=HI, max_tokens=200, temperature=0, **kw)
    chunks = list(c.chat.completions.create(model="qwen3-style", messages=HI, max_tokens=200, temperature=0,
                                            stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert all(ch.usage is None for ch in chunks[:-1])
    return full, chunks[-1].usage


@pytest.mark.parametrize("template, lead", [(QWEN3_STYLE, ["<think>", "\n"]), (R1_STYLE, [])])
def test_reasoning_tokens_count_the_thought_without_the_tags(tokenizer, template, lead):
    """Qwen3-style: the output opens `<think>` itself; R1-style: the prompt opened it. Either way the count is the
    thought's tokens (the newline after `<think>` is thought too, as vLLM counts it), n choices add up."""
    thought_ids = sum((len(tokenizer.encode(t, add_special_tokens=False)) for t in lead[1:] + [THOUGHT]), 0)
    pieces = lead + [THOUGHT, "</think>", "\n\n", ANSWER]
    srv, out_len = server(tokenizer, template, pieces)
    with srv:
        full, streamed = usage_both_ways(srv)
        assert full.choices[0].message.content == ANSWER
        assert full.usage.completion_tokens == out_len
        assert full.usage.completion_tokens_details.reasoning_tokens == thought_ids
        assert streamed.model_dump() == full.usage.model_dump()
        two, streamed2 = usage_both_ways(srv, n=2)
        assert two.usage.completion_tokens_details.reasoning_tokens == 2 * thought_ids
        assert streamed2.completion_tokens_details.reasoning_tokens == 2 * thought_ids
        # the reasoning left out of the message (include_reasoning: false) is still spent, and counted
        hidden, _ = usage_both_ways(srv, extra_body={"include_reasoning": False})
        assert hidden.usage.completion_tokens_details.reasoning_tokens == thought_ids
        # cut before </think>: every token after the start tag is thought
        cut = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0).chat.completions.create(
            model="qwen3-style", messages=HI, max_tokens=len(lead) + 5, temperature=0)
        lead_ids = len(tokenizer.encode(lead[0], add_special_tokens=False)) if lead else 0
        assert cut.choices[0].finish_reason == "length"
        assert cut.usage.completion_tokens_details.reasoning_tokens == cut.usage.completion_tokens - lead_ids


def test_reasoning_tokens_zero_without_reasoning(tokenizer):
    """A thinking model that answers at once, and a model that does not think (no `<think>` in its template):
    the field is there and 0."""
    plain = QWEN3_STYLE.replace("</think>", "</nothink>").replace("<think>", "<nothink>")
    for template in (QWEN3_STYLE, plain):
        srv, out_len = server(tokenizer, template, [ANSWER])
        with srv:
            full, streamed = usage_both_ways(srv)
            assert full.choices[0].message.content == ANSWER
            assert full.usage.completion_tokens == out_len
            assert full.usage.completion_tokens_details.reasoning_tokens == 0
            assert streamed.model_dump() == full.usage.model_dump()


def test_count_matches_vllms_rule_on_token_ids():
    """The count on a toy vocabulary whose tags are single tokens, as vLLM's tests state its rule: tokens strictly
    between the tags; to the end when unclosed; 0 without a start tag; an empty block is 0."""
    from pyengine.server.reasoning import ReasoningParser
    words = {100: "<think>", 101: "</think>", 10: "a", 11: "b", 12: "c", 20: "d", 21: "e"}

    def decode(ids):
        return "".join(words[i] for i in ids)
    p = ReasoningParser()
    assert p.count_reasoning_tokens(decode, [], False) == 0
    assert p.count_reasoning_tokens(decode, [10, 11, 12, 20, 21], False) == 0
    assert p.count_reasoning_tokens(decode, [100, 10, 11, 12, 101, 20, 21], False) == 3
    assert p.count_reasoning_tokens(decode, [100, 10, 11, 12], False) == 3
    assert p.count_reasoning_tokens(decode, [100, 101, 20, 21], False) == 0
    assert p.count_reasoning_tokens(decode, [100, 10, 11, 12, 101], False) == 3
    assert p.count_reasoning_tokens(decode, [101, 10, 11], False) == 0
    assert p.count_reasoning_tokens(decode, [10, 11, 101, 20], True) == 2        # the prompt opened it
