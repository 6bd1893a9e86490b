"""Issue 27 item 6: seeds hold under speculation. On a `pyengine serve --speculative-config` server (n-gram, adaptive
draft lengths: they follow measured step times) the same seeded request gives the same text alone, beside other
requests, and again later -- and that text is the plain server's: the hand-done reference of the plain server's
determinism test (tests/test_server_openai.py `reference_choices`: unbatched, uncached, no speculation). The law:
docs/sampling.md section 5 (one double of the sequence's stream per emitted token, drafts accepted iff they are
the token the row draws)."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from pyengine.server.http_server import ServerThread
from pyengine.sampling_params import SamplingParams
from test_server_openai import reference_choices

MESSAGES = [{"role": "user", "content": "Copy this list twice: red apple, green pear, yellow banana, red apple, "
                                        "green pear, yellow banana."}]
KW = dict(max_tokens=24, temperature=0.6, seed=4321, n=2, top_p=0.95, presence_penalty=0.2,
          extra_body={"top_k": 40, "min_p": 0.02, "ignore_eos": True})
OTHERS = ["Count from one to twenty in words.", "Name three rivers.", "Say hello in five languages."]


@pytest.fixture(scope="module")
def spec_server():
    import argparse

    from pyengine.cli.serve import add_arguments, make_app
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--max-model-len", "512", "--max-num-seqs", "8", "--no-tokenizer-process",
                         "--speculative-config", json.dumps({"method": "ngram", "num_speculative_tokens": 4,
                                                             "prompt_lookup_min": 1})])
    app, engine, model_id = make_app(args)
    with ServerThread(app) as srv:
        srv.model_id, srv.engine = model_id, engine
        yield srv


def test_seeded_text_is_the_same_alone_batched_and_again_and_equals_plain_sampling(spec_server):
    client = openai.OpenAI(base_url=spec_server.url + "/v1", api_key="unused", max_retries=0, timeout=300)

    def ask(**extra):
        r = client.chat.completions.create(model=spec_server.model_id, messages=MESSAGES, logprobs=True, **KW, **extra)
        return [[e.bytes for e in c.logprobs.content] for c in r.choices], [c.message.content for c in r.choices]

    before = spec_server.engine.stats()
    alone = ask()
    with ThreadPoolExecutor(4) as pool:         # beside three other (unseeded, sampled) requests
        others = [pool.submit(client.chat.completions.create, model=spec_server.model_id, max_tokens=24,
                              messages=[{"role": "user", "content": o}], temperature=0.9) for o in OTHERS]
        batched = pool.submit(ask).result()
        for f in others:
            f.result()
    again = ask()
    assert alone[1] == batched[1] == again[1]
    st = spec_server.engine.stats()
    assert st["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"] >= 10, st
    # ... and it is what plain decoding gives, token for token (the plain server's determinism reference)
    eng = spec_server.engine
    tok = eng.get_tokenizer()
    prompt_ids = tok.encode(tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False),
                            add_special_tokens=False)
    params = SamplingParams(n=2, max_tokens=24, temperature=0.6, seed=4321, top_p=0.95, top_k=40, min_p=0.02,
                            presence_penalty=0.2, ignore_eos=True)
    ref = reference_choices(prompt_ids, params, 24)
    for got, r in zip(alone[0], ref):
        assert got == [list(tok.token_bytes(t)) for t, _ in r]
    assert alone[1][0] != alone[1][1]          # two choices, two streams


# --- over the fake runner: every drafter and draft length gives plain sampling's seeded text -------------------
@pytest.mark.parametrize("method", ["one_hot", "draft_model"])
def test_seeded_text_ignores_drafter_draft_length_and_batch(method):
    """A one-hot drafter (the fake model's greedy guesses, some wrong) and a draft model (perturbed logits, its
    guesses drawn with the peeked double): 1, 3 or 4 drafts, adaptive or not, alone or batched -- plain's text."""
    from engine_fakes import make_engine, run_all
    from test_spec_draft_model import PerturbedRunner
    from test_spec_engine import OracleProposer, prompts

    ps = prompts(6, seed=27)
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m, presence_penalty=0.3, seed=60 + i, n=2,
                             max_tokens=24, ignore_eos=True)
              for i, (t, k, p, m) in enumerate([(0.7, 0, 1.0, 0.0), (1.0, 8, 0.9, 0.0), (0.5, 0, 0.8, 0.05),
                                                (1.3, 20, 1.0, 0.1), (0.9, 0, 0.95, 0.0), (0.6, 5, 1.0, 0.0)])]

    def run(spec, together):
        kw = {"draft_runner": PerturbedRunner(num_blocks=256, block_size=4)} if spec and method == "draft_model" else {}
        out, accepted = {}, 0
        groups = [range(len(ps))] if together else [[i] for i in range(len(ps))]
        for g in groups:
            eng = make_engine(num_blocks=256, max_num_seqs=12, max_num_batched_tokens=64, speculative_config=spec, **kw)
            if spec and method == "one_hot":
                eng.spec.proposer = OracleProposer(0.3)
            for i in g:
                eng.add_request(f"r{i}", {"prompt_token_ids": ps[i]}, params[i])
            final = run_all(eng)
            out.update({r: [c.token_ids for c in o.outputs] for r, o in final.items()})
            accepted += eng.stats()["spec_decode_num_accepted_tokens"]
        assert accepted > 0 or not spec
        return out

    plain = run(None, True)
    spec = {"method": "ngram" if method == "one_hot" else method, "num_speculative_tokens": 3}
    if method == "draft_model":
        spec["model"] = "fake"
    for k, adaptive, together in ((1, False, True), (4, False, False), (3, True, True)):
        assert run({**spec, "num_speculative_tokens": k, "adaptive": adaptive}, together) == plain, (k, adaptive)
    assert len({tuple(t) for v in plain.values() for t in v}) == 2 * len(ps)
