"""Structured output through the engine: the fake runner against an engine-free constrained greedy
reference, and the real SmolLM2 model sampled at temperature 1.0 (only the mask keeps it valid), checked by
jsonschema / re."""
import json
import re

import numpy as np
import pytest

from engine_fakes import EOS, FakeRunner, FakeTokenizer, context_logits, reference_greedy
from pyengine.llm import LLM
from pyengine.sampling_params import SamplingParams, StructuredOutputsParams


def fake_llm():
    return LLM(runner=FakeRunner(num_blocks=128, block_size=4), max_model_len=64, max_num_seqs=4,
               max_num_batched_tokens=32)


def constrained_greedy(prompt, allowed_at):
    """Greedy decoding of the fake model where ``allowed_at(i)`` lists the token ids allowed at output
    position i (None: only EOS): no engine, no grammar engine."""
    ctx, out = list(prompt), []
    while True:
        ids = allowed_at(len(out))
        if ids is None:
            return out + [EOS]
        logits = context_logits(ctx)
        t = max(ids, key=lambda i: logits[i])
        out.append(t)
        ctx.append(t)


def test_fake_engine_regex_equals_constrained_reference():
    tok = FakeTokenizer()
    llm = fake_llm()
    abc = [tok.encode(c)[0] for c in "abc"]
    x = tok.encode("x")
    params = SamplingParams(temperature=0, max_tokens=10, structured_outputs=StructuredOutputsParams(regex="[a-c]{3}x"))
    plain = SamplingParams(temperature=0, max_tokens=10)
    prompts = ["hello", "zz"]
    outs = llm.generate(prompts, [params, plain])
    ref = constrained_greedy(tok.encode("hello"), lambda i: abc if i < 3 else x if i == 3 else None)
    assert outs[0].outputs[0].token_ids == ref
    assert re.fullmatch("[a-c]{3}x", outs[0].outputs[0].text)
    assert outs[0].outputs[0].finish_reason == "stop"
    # the unconstrained row of the same batch is untouched
    assert outs[1].outputs[0].token_ids == reference_greedy(tok.encode("zz"), 10)


def test_fake_engine_n_choices_each_valid():
    llm = fake_llm()
    params = SamplingParams(temperature=1.0, seed=3, n=4, max_tokens=8,
                            structured_outputs=StructuredOutputsParams(choice=["ab", "ba", "aaa"]))
    out = llm.generate(["q"], params)[0]
    assert len(out.outputs) == 4
    assert all(o.text in ("ab", "ba", "aaa") and o.finish_reason == "stop" for o in out.outputs)


def test_bad_grammar_is_a_value_error_naming_the_keyword():
    llm = fake_llm()
    params = SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "integer", "multipleOf": 2}))
    with pytest.raises(ValueError, match="multipleOf"):
        llm.generate(["q"], params)
    assert not llm.llm_engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["b"])


# --- the real model ------------------------------------------------------------------------------------
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
     "age": {"type": "integer", "minimum": 0, "maximum": 120}}, "required": ["name", "age"]},
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 15},
     "country": {"type": "string", "enum": ["France", "Spain", "Italy"]}}, "required": ["city", "country"]},
    {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 9}, "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "score": {"type": "number", "minimum": 0,
     "maximum": 10}}, "required": ["ok", "score"]},
]           # a subset: the real model is sampled on these, the random-logits model on the whole corpus


@pytest.fixture(scope="module")
def llm():
    return LLM(max_model_len=512)


def test_real_model_json_schema_at_temperature_one(llm):
    import jsonschema
    finished = 0
    for k, schema in enumerate(SCHEMAS):
        params = SamplingParams(temperature=1.0, seed=k, n=2, max_tokens=40,
                                structured_outputs=StructuredOutputsParams(json=schema))
        out = llm.chat([{"role": "user", "content": "Reply with JSON about a person in Paris."}], params)[0]
        for o in out.outputs:
            assert o.finish_reason in ("stop", "length")
            if o.finish_reason == "stop":
                jsonschema.validate(json.loads(o.text), schema)
                finished += 1
    assert finished >= 3


def test_real_model_stream_regex_and_json_object(llm):
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=20,
                            structured_outputs=StructuredOutputsParams(regex=r"(\+33|0)[1-9]( [0-9]{2}){4}"))
    text = "".join(llm.stream("My phone number is", params))
    assert re.fullmatch(r"(\+33|0)[1-9]( [0-9]{2}){4}", text)
    params = SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=StructuredOutputsParams(json_object=True))
    out = llm.chat([{"role": "user", "content": "Give a JSON object with a key named answer."}], params)[0]
    if out.outputs[0].finish_reason == "stop":
        assert isinstance(json.loads(out.outputs[0].text), dict)
    else:
        assert out.outputs[0].text.startswith("{")
