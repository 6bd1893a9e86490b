"""S13 in Pyodide: the unchanged pyengine wheel (no threads, no C extension of its own) captures and replays
decode steps inside Pyodide under Node, and every replayed step's logits equal the plain step's bit for bit
(np.array_equal), on tiny llama and gemma3 models (sliding window) built on the host (tests/tiny_models.py),
through changing batch compositions: decodes alone, two together, a 4-token verification query."""
from __future__ import annotations

import pytest

from pyodide_harness import harness
from tiny_models import write_tiny

pytestmark = [pytest.mark.pyodide, pytest.mark.slow]

SNIPPET = r"""
import numpy as np
from pyengine.engine.forward_batch import ForwardBatch
from pyengine.engine.model_runner import ModelRunner
bad = []
for variant in ('llama', 'gemma3'):
    data = open(f'/work/tiny/{variant}.gguf', 'rb').read()
    kw = dict(max_model_len=128, max_num_batched_tokens=64, max_num_seqs=4, num_blocks=40, block_size=8)
    plain, replayed = ModelRunner(data, enforce_eager=True, **kw), ModelRunner(data, **kw)
    tables = [np.arange(0, 16, dtype=np.int32), np.arange(16, 32, dtype=np.int32)]
    lens = [0, 0]
    rng = np.random.default_rng(0)
    def step(work, verify=()):
        ids, pos, ql, cl, bt, li = [], [], [], [], [], []
        for s, n in work:
            start = len(ids)
            ids += rng.integers(3, 300, n).tolist()
            pos += range(lens[s], lens[s] + n)
            lens[s] += n
            ql.append(n); cl.append(lens[s]); bt.append(tables[s])
            li += list(range(start, len(ids))) if s in verify else [len(ids) - 1]
        b = ForwardBatch(token_ids=np.array(ids), positions=np.array(pos), query_lens=ql, context_lens=cl,
                         block_tables=bt, logits_indices=np.array(li))
        return plain.run(b).copy(), replayed.run(b)
    step([(0, 30), (1, 20)])
    for t in range(40):
        work = [[(0, 1)], [(0, 1), (1, 1)], [(1, 4)]][t % 3]
        a, b = step(work, {1} if t % 3 == 2 else ())
        if not np.array_equal(a, b):
            bad.append(f'{variant} step {t}')
    g = replayed.graphs
    print(variant, 'captures', g.captures, 'replays', g.replays, 'unplanned', g.unplanned)
    if g.replays < 30:
        bad.append(f'{variant}: only {g.replays} replays')
assert not bad, bad
"""


def test_replay_is_bit_identical_in_pyodide(tmp_path):
    if harness.missing_setup():
        pytest.fail(harness.missing_setup())
    files = {f"/work/tiny/{v}.gguf": write_tiny(tmp_path / f"{v}.gguf", v, seed=2) for v in ("llama", "gemma3")}
    report = harness.run_in_pyodide(SNIPPET, files=files)
    assert report["ok"], harness.describe(report)
    assert report["stdout"].count("replays") == 2, report["stdout"]
