"""S15 x S14 on the real model (SmolLM2-135M Q4_1, its 49152-token vocabulary: tokens end mid-keyword): greedy
constrained decoding (JSON Schema with n = 2, regex, choice, GBNF) batched with an unconstrained prompt emits
the tokens of the same requests without speculation, with n-gram lookup and with SmolLM2 drafting for itself;
sampled at temperature 1.0 with speculation (only the mask keeps it valid) every output validates with
jsonschema / Python's `re`.

A verification scores k+1 rows in one pass where plain decoding scores one: float32 sums round differently, so
greedy may differ only where the top-2 margin *among the tokens the grammar allows* is below TIE (the rule of
test_spec_greedy_real.py); any other difference fails.
"""
from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest

from engine_fakes import run_all
from pyengine.sampling_params import SamplingParams, StructuredOutputsParams as SO

pytestmark = pytest.mark.slow
TIE = 2e-3
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 16}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "city": {"type": "string", "enum": ["Paris", "London", "Rome"]}}, "required": ["name", "age", "city"],
    "additionalProperties": False}
CHOICE = ["red apple", "green apple", "yellow banana", "green banana split"]
DATE = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
GBNF = 'root ::= item "," item "," item "."\nitem ::= [a-z]+\n'
PEOPLE = ('People as JSON:\n{"name":"Alice","age":31,"city":"Paris"}\n{"name":"Bob","age":42,"city":"Rome"}\n'
          '{"name":"Carol","age":27,"city":"London"}\n')
CASES = [   # (prompt, constraint or None, check of a finished text)
    (PEOPLE, SO(json=SCHEMA), lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
    ("Dates: 2021-03-14, 2021-03-15, 2021-03-16, 2021-03-17. The next date is ", SO(regex=DATE),
     lambda t: re.fullmatch(DATE, t) is not None),
    ("Pick a fruit.\ngreen apple\nred apple\nyellow banana\ngreen apple\n", SO(choice=CHOICE),
     lambda t: t in CHOICE),
    ("Fruits: apple,pear,plum.\nFruits: pear,plum,apple.\nFruits: ", SO(grammar=GBNF),
     lambda t: re.fullmatch(r"[a-z]+,[a-z]+,[a-z]+\.", t) is not None),
    ("1, 2, 3, 4, 5, 6, 7, 8,", None, None),
]


@pytest.fixture(scope="module")
def runner():
    from pyengine.engine.model_runner import ModelRunner
    from pyengine.model_files import default_model_path
    return ModelRunner(default_model_path(), max_model_len=256, num_blocks=160, block_size=16,
                       max_num_batched_tokens=512, max_num_seqs=8, max_logits=64)


def run(runner, spec, temperature=0.0, n=2, max_tokens=32):
    from pyengine.engine.llm_engine import LLMEngine
    eng = LLMEngine(runner=runner, max_model_len=256, max_num_seqs=8, max_num_batched_tokens=512,
                    speculative_config=spec)
    for i, (prompt, so, _) in enumerate(CASES):
        eng.add_request(f"q{i}", prompt, SamplingParams(temperature=temperature, seed=11 + i, max_tokens=max_tokens,
                                                        n=n if i == 0 else 1, structured_outputs=so))
    final = run_all(eng)                # also checks that the streamed deltas add up to the text
    assert eng.num_used_blocks() == 0
    return [final[f"q{i}"] for i in range(len(CASES))], eng


def allowed_margin(eng, runner, prompt, so, out, k):
    """Top-2 margin among the grammar's tokens of one unbatched teacher-forced pass at generated step k."""
    ids = eng.input_processor.encode(prompt)[1] + list(out[:k])
    logits = np.array(runner.run(runner.contiguous_batch(ids, 0))[0], dtype=np.float64)
    if so is not None:
        m = eng.input_processor.matchers(SamplingParams(structured_outputs=so), 1)[0]
        assert m.accept_draft(out[:k]) == k
        logits = m.mask_logits(logits)
    top2 = np.sort(logits)[-2:]
    return float(top2[1] - top2[0])


def check_valid(outs):
    for (_, so, check), o in zip(CASES, outs):
        for c in o.outputs:
            if so is not None and c.finish_reason == "stop":
                assert check(c.text), c.text


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_greedy_constrained_speculation_equals_plain(runner, method):
    from pyengine.model_files import default_model_path
    spec = ({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
             "adaptive": False} if method == "ngram" else
            {"method": "draft_model", "model": default_model_path(), "num_speculative_tokens": 3, "adaptive": False})
    plain, eng = run(runner, None)
    outs, seng = run(runner, spec)
    for i, ((prompt, so, _), got, want) in enumerate(zip(CASES, outs, plain)):
        for g, w in zip(got.outputs, want.outputs):
            if g.token_ids != w.token_ids:
                k = next(j for j, (a, b) in enumerate(zip(g.token_ids, w.token_ids)) if a != b)
                margin = allowed_margin(eng, runner, prompt, so, w.token_ids, k)
                assert margin < TIE, f"case {i} differs from plain at step {k}, margin {margin:.4f}"
    check_valid(outs)
    assert all(c.finish_reason == "stop" for o in outs[:4] for c in o.outputs)
    st = seng.stats()
    for o in outs[:4]:          # every constrained request was speculated on, and drafts were accepted
        assert o.metrics.num_draft_tokens > 0 and o.metrics.num_accepted_tokens > 0
    if method == "ngram":
        assert st["spec_decode_num_grammar_cut_tokens"] > 0
    else:                       # SmolLM2 drafting for itself under the same masks: (nearly) all accepted
        assert st["spec_decode_num_grammar_cut_tokens"] == 0
        assert st["spec_decode_acceptance_rate"] > 0.9


def test_sampled_constrained_speculation_is_valid(runner):
    outs, eng = run(runner, {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                             "adaptive": False}, temperature=1.0, n=3, max_tokens=48)
    check_valid(outs)
    assert sum(c.finish_reason == "stop" for o in outs[:4] for c in o.outputs) >= 4
    st = eng.stats()
    assert st["spec_decode_num_accepted_tokens"] > 0 and st["spec_decode_num_grammar_cut_tokens"] > 0


def test_bench_structured_speculative_section():
    """`pyengine bench structured --speculative` prints plain vs speculative constrained generation, with the same
    tokens (greedy), drafts accepted, and finite ratios."""
    from test_bench_quick import NUMBER, bench, finite_positive
    out = bench("structured", "--limit", "1", "--engines", "pyengine", "--tokens", "10", "--speculative")
    rows = re.findall(rf"^(plain|forced|adaptive)\s+(\d+)\s+(\d+)\s+({NUMBER})\s+({NUMBER})x\s+({NUMBER})\s+(\d+)$",
                      out, re.M)
    assert [r[0] for r in rows] == ["plain", "forced", "adaptive"], out
    (_, ntok, steps, *_), (_, ntok_s, steps_s, _, _, accept, cuts) = rows[:2]
    assert ntok == ntok_s and int(steps_s) < int(steps) and float(accept) > 1.0 and int(cuts) > 0
    finite_positive(re.findall(rf"^(?:forced|adaptive) vs plain: ({NUMBER})x faster, same tokens: yes$", out, re.M),
                    "speed ratios", 2)
