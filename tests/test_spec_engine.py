"""S14 speculative decoding through the engine, over the fake runner of the engine tests (logits depend on the
whole context read back through the block tables, so a stale rejected-draft slot changes the output).

The reference is `reference_greedy` (no engine). Drafts come from an oracle proposer that knows the fake
model and corrupts some guesses, so verifications accept every length 0..k; invariants of the block manager
are checked after every step, and rolled-back blocks must never enter the prefix cache.
"""
import random

import numpy as np
import pytest

from engine_fakes import VOCAB, FakeTokenizer, context_logits, make_engine, reference_greedy, run_all
from pyengine.engine.proposers import NgramIndex, NgramProposer, ngram_lookup
from pyengine.engine.spec_decode import SpeculativeConfig, expected_tokens
from pyengine.layers.sampler import softmax
from pyengine.sampling_params import SamplingParams
from test_engine_fake_runner import check_against_reference


class OracleProposer:
    """Greedy continuation of the fake model, with guess j of a round wrong when a hash says so."""
    free = True
    relative_cost = 0.0

    def __init__(self, wrong_rate=0.3, seed=0, sampled_q=False):
        self.wrong_rate, self.seed, self.sampled_q = wrong_rate, seed, sampled_q
        self.calls = 0

    def propose(self, seqs, ks, rngs=None):
        self.calls += 1
        out = []
        for seq, k, rng in zip(seqs, ks, rngs or [None] * len(seqs)):
            ctx, ids, probs = list(seq.token_ids), [], []
            r = random.Random(hash((self.seed, seq.seq_id, seq.num_tokens)))
            for _ in range(k):
                logits = context_logits(ctx)
                if self.sampled_q:               # a drafter with its own (flatter) distribution q
                    q = softmax(logits.astype(np.float64) / 1.7)
                    t = int(rng.choice(VOCAB, p=q))
                    probs.append(q)
                else:
                    t = int(np.argmax(logits))
                    if r.random() < self.wrong_rate:
                        t = (t + 1 + r.randrange(VOCAB - 1)) % VOCAB
                ids.append(t)
                ctx.append(t)
            out.append((ids, np.stack(probs) if probs else None))
        return out

    def release(self, seq):
        pass


def spec_engine(k=4, proposer=None, **kw):
    eng = make_engine(speculative_config={"method": "ngram", "num_speculative_tokens": k, "adaptive": False}, **kw)
    if proposer is not None:
        eng.spec.proposer = proposer
    return eng


def prompts(n, seed=0, lo=3, hi=40):
    rng = random.Random(seed)
    return [[rng.randrange(1, VOCAB) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def invariants(engine):
    bm = engine.block_manager
    bm.check_invariants(list(engine.scheduler.running))
    for s in engine.scheduler.running:   # after a step no sequence holds a block beyond its computed tokens
        assert len(s.block_table) == bm.blocks_for(s.num_computed_tokens), s
        assert not s.spec_token_ids
    for b, toks in enumerate(bm.block_tokens):      # every cached block holds real (accepted) tokens
        if toks is not None:
            assert all(0 <= t < VOCAB for t in toks)


def add_all(engine, ps, params):
    for i, p in enumerate(ps):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, params)


@pytest.mark.parametrize("k", [1, 3, 7])
def test_greedy_with_drafts_equals_reference_batched(k):
    ps = prompts(12, seed=k)
    eng = spec_engine(k, OracleProposer(0.3, seed=k), num_blocks=256, max_num_seqs=12, max_num_batched_tokens=256)
    add_all(eng, ps, SamplingParams(temperature=0.0, max_tokens=30))
    final = run_all(eng, check=invariants)
    check_against_reference(final, ps, 30)
    st = eng.stats()
    assert st["spec_decode_num_drafts"] > 0 and 0 < st["spec_decode_num_accepted_tokens"] < \
        st["spec_decode_num_draft_tokens"]
    assert eng.num_used_blocks() == 0
    # fewer forward passes than tokens: verification emitted several tokens per step
    assert eng.counters["steps"] < sum(len(f.outputs[0].token_ids) for f in final.values())
    m = [f.metrics for f in final.values()]
    assert sum(x.num_drafts for x in m) == st["spec_decode_num_drafts"]
    assert sum(x.num_accepted_tokens for x in m) == st["spec_decode_num_accepted_tokens"]
    assert st["spec_decode_mean_acceptance_length"] == pytest.approx(
        1 + st["spec_decode_num_accepted_tokens"] / st["spec_decode_num_drafts"])


def test_all_wrong_and_all_right_drafts():
    ps = prompts(4, seed=9)
    for rate in (0.0, 1.0):
        eng = spec_engine(4, OracleProposer(rate), num_blocks=128)
        add_all(eng, ps, SamplingParams(temperature=0.0, max_tokens=25, ignore_eos=True))
        final = run_all(eng, check=invariants)
        for i, p in enumerate(ps):
            assert final[f"r{i}"].outputs[0].token_ids == reference_greedy(p, 25, ignore_eos=True)
        st = eng.stats()
        if rate == 1.0:
            assert st["spec_decode_num_accepted_tokens"] == 0
        else:
            assert st["spec_decode_num_accepted_tokens"] == st["spec_decode_num_draft_tokens"]


def test_prefix_cache_chunked_prefill_and_preemption_with_drafts():
    shared = prompts(1, seed=3, lo=30, hi=31)[0]
    ps = [shared + p for p in prompts(10, seed=4, lo=2, hi=20)]
    # tight pool: sequences are preempted and recomputed; budget 24 splits the prompts into chunks
    eng = spec_engine(5, OracleProposer(0.25, seed=1), num_blocks=40, block_size=4, max_num_seqs=6,
                      max_num_batched_tokens=24)
    add_all(eng, ps, SamplingParams(temperature=0.0, max_tokens=30))
    final = run_all(eng, check=invariants)
    check_against_reference(final, ps, 30)
    st = eng.stats()
    assert st["num_preemptions"] > 0 and st["prefix_cache_hits"] > 0 and st["spec_decode_num_accepted_tokens"] > 0
    # prefix-cache blocks are only full blocks of real tokens: re-running one prompt must hit its prompt blocks
    eng.add_request("again", {"prompt_token_ids": ps[0]}, SamplingParams(temperature=0.0, max_tokens=30))
    again = run_all(eng, check=invariants)["again"]
    assert again.outputs[0].token_ids == reference_greedy(ps[0], 30)


def test_stop_string_max_tokens_and_eos_inside_an_accepted_run():
    tok = FakeTokenizer()
    p = prompts(1, seed=11, lo=8, hi=9)[0]
    ref = reference_greedy(p, 40, ignore_eos=True)
    text = tok.decode(ref)
    # a stop string made of tokens 5..7 of the reference: drafts of 7 make it fall inside one verification
    stop = text[5:8]
    for params, want_ids, reason in [
        (SamplingParams(temperature=0.0, max_tokens=13, ignore_eos=True), ref[:13], "length"),
        (SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=[stop]), None, "stop"),
        (SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[ref[9]], ignore_eos=True), None, "stop"),
    ]:
        eng = spec_engine(7, OracleProposer(0.0), num_blocks=64)
        eng.add_request("r", {"prompt_token_ids": p}, params)
        out = run_all(eng, check=invariants)["r"].outputs[0]
        assert out.finish_reason == reason
        if want_ids is not None:
            assert out.token_ids == want_ids
        elif params.stop:
            assert out.text == text[:text.index(stop)] and out.stop_reason == stop
        else:
            cut = ref.index(ref[9]) + 1
            assert out.token_ids == ref[:cut] and out.stop_reason == ref[9]
        assert eng.num_used_blocks() == 0


def test_streaming_deltas_carry_several_tokens_and_add_up():
    p = prompts(1, seed=5)[0]
    eng = spec_engine(4, OracleProposer(0.0), num_blocks=64)
    eng.add_request("r", {"prompt_token_ids": p}, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    toks, text, sizes = [], "", []
    while eng.has_unfinished_requests():
        for out in eng.step():
            c = out.outputs[0]
            toks += c.delta_token_ids
            text += c.delta_text
            sizes.append(len(c.delta_token_ids))
    assert toks == reference_greedy(p, 20, ignore_eos=True) == c.token_ids
    assert text == c.text and max(sizes) == 5


def test_n_and_seeded_sampling_are_reproducible_and_opt_out_works():
    p = prompts(1, seed=6)[0]
    params = SamplingParams(n=3, temperature=0.9, top_k=20, max_tokens=20, seed=7, ignore_eos=True)

    def run(proposer, speculative=True):
        eng = spec_engine(3, proposer, num_blocks=128)
        eng.add_request("r", {"prompt_token_ids": p}, params.clone(speculative=speculative))
        return [c.token_ids for c in run_all(eng, check=invariants)["r"].outputs], eng.stats()

    a, st = run(OracleProposer(0.0))
    b, _ = run(OracleProposer(0.0))
    assert a == b and st["spec_decode_num_drafts"] > 0          # the request's seed fixes the whole run
    _, st = run(OracleProposer(0.0), speculative=False)
    assert st["spec_decode_num_drafts"] == 0                     # the per-request opt-out


def test_penalties_and_logit_bias_see_the_drafts_before_each_row():
    """Greedy with a repetition penalty and a bias: row i's processors must count drafts 1..i as output."""
    from pyengine.layers.sampler import sample_row
    p = prompts(1, seed=8)[0]
    params = SamplingParams(temperature=0.0, max_tokens=24, repetition_penalty=1.6, frequency_penalty=0.7,
                            logit_bias={3: 2.5}, ignore_eos=True)
    ctx, ref = list(p), []
    for _ in range(24):                                            # the reference: no engine
        t = sample_row(context_logits(ctx), params, None, p, ref)
        ref.append(t)
        ctx.append(t)

    class PenaltyOracle(OracleProposer):
        def propose(self, seqs, ks, rngs=None):
            out = []
            for seq, k in zip(seqs, ks):
                c, o, ids = list(seq.token_ids), list(seq.output_token_ids), []
                for _ in range(k):
                    t = sample_row(context_logits(c), params, None, seq.prompt_token_ids, o)
                    ids.append(t)
                    c.append(t)
                    o.append(t)
                out.append((ids, None))
            return out

    eng = spec_engine(4, PenaltyOracle(), num_blocks=64)
    eng.add_request("r", {"prompt_token_ids": p}, params)
    out = run_all(eng, check=invariants)["r"].outputs[0]
    assert out.token_ids == ref
    st = eng.stats()
    assert st["spec_decode_num_accepted_tokens"] == st["spec_decode_num_draft_tokens"] > 0


def test_ngram_index_equals_the_scan_as_the_sequence_grows():
    """The proposer's incremental index gives what the plain scan (ngram_lookup) gives, after every append,
    for every k and n range, on streams with many repeats (a 4-token vocabulary); a sequence that is not a
    continuation of the indexed one (a new prompt under the same id) is re-indexed."""
    rng = np.random.default_rng(5)
    for n_min, n_max in ((1, 1), (1, 3), (2, 5), (3, 3)):
        for _ in range(20):
            ix, toks = NgramIndex(n_min, n_max), []
            for _ in range(12):
                toks += rng.integers(0, 4, int(rng.integers(1, 6))).tolist()
                ix.extend(toks)
                for k in (1, 3, 8):
                    assert ix.lookup(k) == ngram_lookup(np.array(toks), k, n_min, n_max), (toks, k, n_min, n_max)
            other = [9, 8, 9, 8, 9]
            ix.extend(other)
            assert ix.lookup(2) == ngram_lookup(np.array(other), 2, n_min, n_max) and ix.tokens == other


def test_ngram_lookup():
    t = np.array([1, 2, 3, 4, 9, 1, 2, 3, 5, 7, 1, 2, 3])
    assert ngram_lookup(t, 3, 1, 3) == [5, 7, 1]           # latest earlier occurrence of [1, 2, 3]
    assert ngram_lookup(t, 9, 3, 3) == [5, 7, 1, 2, 3]     # stops at the end of the sequence
    assert ngram_lookup(np.array([1, 2, 3, 4]), 3, 1, 3) == []
    assert ngram_lookup(np.array([5, 6, 8, 6]), 2, 1, 2) == [8, 6]   # falls back to n = 1
    assert ngram_lookup(np.array([5, 6, 8, 6]), 2, 2, 2) == []


def test_ngram_engine_on_a_repetitive_prompt_accepts_and_matches_reference():
    base = prompts(1, seed=12, lo=12, hi=13)[0]
    ps = [base * 3, prompts(1, seed=13)[0]]
    eng = make_engine(speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                          "prompt_lookup_min": 1, "prompt_lookup_max": 3}, num_blocks=128)
    assert isinstance(eng.spec.proposer, NgramProposer)
    add_all(eng, ps, SamplingParams(temperature=0.0, max_tokens=30))
    final = run_all(eng, check=invariants)
    check_against_reference(final, ps, 30)
    assert eng.stats()["spec_decode_num_drafts"] > 0


def priced(engine):
    """Feed the back-off a fixed cost model instead of the fake runner's (noisy, near-zero) step times:
    a step with k drafts in all costs 1 + 0.5 + 0.1 k plain steps (like the real runner)."""
    observe = engine.spec.observe_step
    engine.spec.observe_step = lambda seconds, n, k: observe(1.0 + (0.5 + 0.1 * k if k else 0.0), n, k)
    return engine


def test_backoff_stops_drafting_when_acceptance_is_low():
    ps = prompts(2, seed=14)
    eng = priced(make_engine(speculative_config={"method": "ngram", "num_speculative_tokens": 4}, num_blocks=128))
    eng.spec.proposer = OracleProposer(1.0)                  # every guess wrong
    add_all(eng, ps, SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True))
    final = run_all(eng, check=invariants)
    for i, p in enumerate(ps):
        assert final[f"r{i}"].outputs[0].token_ids == reference_greedy(p, 60, ignore_eos=True)
    st = eng.stats()
    # after a few failed rounds the sequences stop drafting (the free proposer's guesses are still scored)
    assert st["spec_decode_num_drafts"] <= 2 * 8
    eng2 = priced(make_engine(speculative_config={"method": "ngram", "num_speculative_tokens": 4}, num_blocks=128))
    eng2.spec.proposer = OracleProposer(0.0)
    add_all(eng2, ps, SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True))
    run_all(eng2, check=invariants)
    assert eng2.stats()["spec_decode_mean_acceptance_length"] > 3       # good drafts keep k high
    assert expected_tokens(0.5, 2) == 1.75


def test_config_errors_are_clear():
    for bad, word in [({"method": "medusa", "num_speculative_tokens": 2}, "method"),
                      ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
                      ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
                        "prompt_lookup_max": 2}, "prompt_lookup_min"),
                      ({"method": "ngram", "num_speculative_tokens": 2, "foo": 1}, "unknown"),
                      ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
                      ("ngram", "dict")]:
        with pytest.raises(ValueError, match=word):
            SpeculativeConfig.from_dict(bad)
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (4, 4)
    with pytest.raises(ValueError, match="speculative"):
        SamplingParams(speculative=1)


def test_drafts_never_pass_the_context_limit():
    p = prompts(1, seed=15, lo=21, hi=22)[0]
    eng = spec_engine(7, OracleProposer(0.0), num_blocks=64, max_model_len=48)
    eng.add_request("r", {"prompt_token_ids": p}, SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True))
    out = run_all(eng, check=invariants)["r"].outputs[0]
    assert out.token_ids == reference_greedy(p, 48 - len(p), ignore_eos=True)
    assert out.finish_reason == "length" and max(c for _, cl in eng.runner.batches for c in cl) <= 48


def test_an_expensive_proposer_probes_less_and_less_when_it_does_not_pay():
    from pyengine.tuning import PROBE_GAP
    ps = prompts(1, seed=16)
    eng = priced(make_engine(speculative_config={"method": "ngram", "num_speculative_tokens": 4}, num_blocks=128,
                             max_model_len=512))
    wrong = OracleProposer(1.0)
    wrong.free = False                       # like a draft model: no shadow guesses, only probes
    eng.spec.proposer = wrong
    add_all(eng, ps, SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True))
    final = run_all(eng, check=invariants)
    assert final["r0"].outputs[0].token_ids == reference_greedy(ps[0], 300, ignore_eos=True)
    st = eng.stats()
    # each unmeasured draft length tried once (4, 3, 2, 1) while the prior acceptance lasts, then probes
    # after 8, 16, 32, 64, 128 steps: about ten rounds in 300 tokens, instead of 300
    assert 5 <= st["spec_decode_num_drafts"] <= 10, st["spec_decode_num_drafts"]
    assert PROBE_GAP == 8


class _Seq:
    """What the back-off reads of a sequence."""
    def __init__(self, alpha, room=4):
        self.spec_alpha, self.max_tokens, self.num_output_tokens, self.num_tokens = alpha, room + 1, 0, 10
        self.spec_probe_gap, self.spec_probe_at = 8, None


def _decoder(costs, batch, k=4):
    """A decoder whose step times are given: ``costs[m]`` for m drafts per sequence (``costs[0]``: plain)."""
    from pyengine.engine.spec_decode import SpeculativeDecoder, _bucket
    dec = SpeculativeDecoder(SpeculativeConfig("ngram", k), NgramProposer(1, 3), max_model_len=1024)
    for m, c in enumerate(costs):
        dec._time[(_bucket(batch), m)], dec._measured[(_bucket(batch), m)] = c, 1
    dec._steps = 2
    return dec


def test_backoff_chooses_for_the_batch_not_for_its_luckiest_sequence():
    """Eight sequences share a step whose cost grows with the drafts of all: one sequence that accepts 95% of its
    drafts does not make the other seven pay for drafts they would waste (alone, it would draft 4), while a
    batch of good drafters drafts fully, and drafts go to the most promising sequences first (a prefix of each)."""
    costs = [1.0, 1.5, 1.6, 1.7, 1.8]                      # plain step, then 1..4 drafts per sequence
    one_good = [_Seq(0.95)] + [_Seq(0.05) for _ in range(7)]
    assert _decoder(costs, 8).draft_lens(one_good) == [0] * 8
    assert _decoder(costs, 1).draft_lens(one_good[:1]) == [4]
    assert _decoder(costs, 8).draft_lens([_Seq(0.95) for _ in range(8)]) == [4] * 8
    # two sequences, two drafts each in cost: the four best draft tokens are 0.9, 0.81, 0.73 (then 0.66) and 0.7
    assert _decoder([1.0, 1.05, 1.1, 3.0, 3.0], 2).draft_lens([_Seq(0.9), _Seq(0.7)]) == [3, 1]
    # no room (max_tokens reached next step): no drafts, whatever the acceptance
    assert _decoder(costs, 1).draft_lens([_Seq(0.99, room=0)]) == [0]
    # a free proposer's guesses come first: sequences it found nothing for add no phantom gains
    prior = [_Seq(0.6) for _ in range(8)]
    assert _decoder(costs, 8).draft_lens(prior) == [4] * 8
    assert _decoder(costs, 8).draft_lens(prior, available=[4] + [0] * 7) == [0] * 8


class _Graphs:
    captures = 0


@pytest.mark.parametrize("capture_every", [0, 1, 3])
def test_a_step_that_captured_is_no_cost_sample(capture_every):
    """S13 x S14: a step during which the runner captured a new bucket costs more than its replays will, so the
    back-off does not price its draft length by it; the other decode-only steps are samples."""
    eng = make_engine(speculative_config={"method": "ngram", "num_speculative_tokens": 4}, num_blocks=128)
    eng.runner.graphs = graphs = _Graphs()
    run, calls, captured = eng.runner.run, [0], []

    def capturing_run(batch):
        calls[0] += 1
        if capture_every and calls[0] % capture_every == 0:
            graphs.captures += 1
            captured.append(calls[0])
        return run(batch)
    eng.runner.run = capturing_run
    samples = []
    observe = eng.spec.observe_step
    eng.spec.observe_step = lambda s, n, k: (samples.append(calls[0]), observe(s, n, k))
    add_all(eng, prompts(2, seed=21), SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    run_all(eng)
    assert not set(samples) & set(captured)
    assert (samples == []) == (capture_every == 1)       # the others' decode-only steps are samples
