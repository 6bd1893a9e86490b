"""The demo's live panel and multi-turn chat, Python side (web/pyworker.py over LLMEngine.snapshot), in CPython
on the tiny seeded llama: the block map agrees with the block manager's own counts, a conversation's second turn
reuses exactly the prefix-cache blocks its first turn left (computed here from the token ids), speculative
decoding is switched per request, the step time split adds up, the grammar mask size is the mask's own count.
The same code runs in Chromium in e2e/test_demo_live.py.
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
from moe_models import write_moe

HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("pyworker_live", HERE.parent / "web" / "pyworker.py")
pyworker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pyworker)


@pytest.fixture(scope="module")
def tiny_bytes(tmp_path_factory) -> bytes:
    """The tiny seeded Mixtral-shaped llama of tests/moe_models.py: SmolLM2's tokenizer, so chat works."""
    from pyengine.model_files import default_model_path
    path = tmp_path_factory.mktemp("live") / "tiny.gguf"
    write_moe(path, "mixtral", default_model_path())
    return path.read_bytes()


def run(s, live=True):
    events, snaps = [], []
    while s.has_work():
        events += s.step()
        if live:
            snaps.append(s.live())
    return events, snaps


def done_of(events, rid):
    return next(e for e in events if e["type"] == "done" and e["id"] == rid)


def lcp(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def test_block_map_matches_the_block_manager(tiny_bytes):
    s = pyworker.WorkerSession()
    s.load(tiny_bytes, max_model_len=256)
    s.start("a", "hello world " * 5, max_tokens=6, temperature=0.0)
    s.start("b", "one two three", max_tokens=4, temperature=0.0)
    s.step()
    snap = s.live()
    bm = s.engine.block_manager
    blocks = snap["blocks"]
    assert len(blocks) == snap["totalBlocks"] == bm.num_blocks
    assert sum(1 for b in blocks if b in (1, 2)) == snap["usedBlocks"] == bm.num_used_blocks()
    assert sum(1 for b in blocks if b in (0, 3)) == snap["freeBlocks"] == bm.num_free_blocks()
    assert sum(1 for b in blocks if b in (2, 3)) == snap["cachedBlocks"]
    # each request owns exactly its sequence's block table, and owned blocks are the used ones
    for rid in ("a", "b"):
        seq = s.engine.requests[rid].seqs[0]
        assert snap["owners"][rid] == seq.block_table and seq.block_table
    owned = {b for bl in snap["owners"].values() for b in bl}
    assert owned == {i for i, b in enumerate(blocks) if b in (1, 2)}
    assert snap["running"] + snap["waiting"] == 2
    events, _ = run(s)
    after = s.live()
    assert after["usedBlocks"] == 0 and after["owners"] == {} and after["running"] == after["waiting"] == 0
    # finished sequences leave their full blocks in the prefix cache (state 3: free, holding a prefix)
    assert after["cachedBlocks"] == sum(1 for b in after["blocks"] if b == 3) > 0


def test_second_chat_turn_reuses_the_first_turns_blocks(tiny_bytes):
    s = pyworker.WorkerSession()
    s.load(tiny_bytes, max_model_len=256)
    tok = s.engine.get_tokenizer()
    bs = s.engine.block_manager.block_size
    turn1 = [{"role": "user", "content": "tell me a story about a cat and a dog and a bird " * 2}]
    s.start("t1", "", max_tokens=12, temperature=0.0, messages=json.dumps(turn1))
    events, _ = run(s)
    d1 = done_of(events, "t1")
    assert d1["cachedTokens"] == 0
    turn2 = turn1 + [{"role": "assistant", "content": d1["text"]}, {"role": "user", "content": "and then?"}]
    s.start("t2", "", max_tokens=4, temperature=0.0, messages=turn2)
    s.step()
    live2 = s.live()
    events, _ = run(s)
    d2 = done_of(events, "t2")
    # expected reuse, from the token ids: the first turn's computed tokens (prompt + output, the last sampled
    # token never ran through the model) shared with the second prompt, in whole blocks, never its last token
    p1 = tok.encode_chat(turn1)[1]
    p2 = tok.encode_chat(turn2)[1]
    seq1 = p1 + d1["tokenIds"]
    common = lcp(seq1[:len(seq1) - 1], p2)
    expected = min(common, len(p2) - 1) // bs * bs
    assert expected >= bs
    assert d2["cachedTokens"] == expected
    assert live2["requests"]["t2"]["cachedTokens"] == expected
    assert live2["prefixHitTokens"] >= expected


def test_messages_are_checked(tiny_bytes):
    s = pyworker.WorkerSession()
    s.load(tiny_bytes, max_model_len=256)
    for bad in ([], [{"role": "wizard", "content": "x"}], [{"role": "user"}], "{}"):
        with pytest.raises((ValueError, json.JSONDecodeError)):
            s.start("x", "", messages=bad if not isinstance(bad, list) else json.dumps(bad))
    assert not s.has_work()


def test_speculative_switch_per_request_and_step_split():
    """SmolLM2 (a random model never repeats itself, so n-gram drafts would never come)."""
    from pyengine.model_files import default_model_path
    s = pyworker.WorkerSession()
    s.load(Path(default_model_path()).read_bytes(), max_model_len=256,
           speculative={"method": "ngram", "num_speculative_tokens": 3})
    prompt = "1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 4,"
    s.start("off", prompt, max_tokens=12, temperature=0.0, speculative=False)
    ev_off, snaps = run(s)
    off = done_of(ev_off, "off")
    assert off["numDraftTokens"] == 0 and all(sn["specDraftTokens"] == 0 for sn in snaps)
    for sn in snaps:
        ms = sn["stepMs"]
        assert set(ms) == {"plan", "forward", "sample"} and min(ms.values()) >= 0 and ms["forward"] > 0
    s.start("on", prompt, max_tokens=12, temperature=0.0, speculative=True)
    ev_on, snaps = run(s)
    on = done_of(ev_on, "on")
    assert on["tokenIds"] == off["tokenIds"]                  # greedy: drafts never change the tokens
    assert on["numDraftTokens"] > 0
    assert snaps[-1]["specDraftTokens"] == on["numDraftTokens"]
    assert snaps[-1]["specAcceptedTokens"] == on["numAcceptedTokens"]
    seen = [sn["requests"]["on"]["draftTokens"] for sn in snaps if "on" in sn["requests"]]
    assert seen == sorted(seen) and seen[-1] <= on["numDraftTokens"]


def test_grammar_mask_size_is_the_masks_count(tiny_bytes):
    s = pyworker.WorkerSession()
    s.load(tiny_bytes, max_model_len=256)
    s.start("j", "JSON:", max_tokens=6, temperature=0.0, json_schema="")
    sizes = []
    while s.has_work():
        s.step()
        if "j" in s.engine.requests:
            req = s.engine.requests["j"]
            want = int(np.count_nonzero(req.matchers[0].allowed_mask()))
            got = s.live()["requests"]["j"]["grammarMaskSize"]
            assert got == want and 0 < got < s.info["vocabSize"]
            sizes.append(got)
    assert sizes
    s.start("free", "x", max_tokens=3, temperature=0.0)
    s.step()
    assert s.live()["requests"]["free"]["grammarMaskSize"] is None      # no JSON mode: no mask
    run(s, live=False)
