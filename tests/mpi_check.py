"""Run under mpiexec by tests/test_mpi_parallel.py and tests/test_model_contracts.py: one MPI job with
``--tp`` x ``--pp`` ranks builds the parallel runner and writes, from rank 0, what the test compares against one
process: logits of a prompt and of passes after it (``--logits``), and batched greedy continuations through the
LLMEngine (``--prompts``, a JSON list; decoded together, so passes are batched with other sequences). With
pipeline stages the engine keeps one step of each group of sequences in flight (cross-step pipelining), and
the logits passes are also run that way (``logits_cross.npz``).

    mpiexec -n 2 python tests/mpi_check.py --model M --tp 2 --pp 1 --out DIR [--prompts P.json] [--kw JSON]

``--model`` given several times runs each model in turn in the same job (a fresh group each), writing to
DIR/0, DIR/1, ...: one mpiexec start-up for several small models.
"""
import argparse
import json
import os
import sys

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, action="append", help="GGUF file (repeat: several models in turn)")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--out", required=True)
    ap.add_argument("--kw", default="{}", help="ModelRunner keyword arguments (JSON)")
    ap.add_argument("--logits", default="[[33, 5], [20, 6]]", help="JSON [[n, seed], ...]: a context, then passes")
    ap.add_argument("--prompts", default=None, help="JSON file: prompts for batched greedy decoding")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--runner-greedy", action="store_true", help="greedy on the runner itself (no tokenizer)")
    a = ap.parse_args()
    for k, model in enumerate(a.model):       # several models: one after the other, each in out/<k>
        out_dir = a.out if len(a.model) == 1 else os.path.join(a.out, str(k))
        os.makedirs(out_dir, exist_ok=True)
        run_model(a, model, out_dir)


def run_model(a, model: str, out_dir: str) -> None:
    from pyengine.engine.model_runner import ModelRunner
    from pyengine.parallel.executor import MPIExecutor
    from pyengine.parallel.mpi import MPIGroup

    group = MPIGroup(a.tp, a.pp)
    runner = ModelRunner(model, shard=group, **json.loads(a.kw))
    if group.rank != 0:
        group.worker_loop(runner)
        return
    ex = MPIExecutor(runner, group)           # rank 0 drives every rank's runner
    try:
        out = {"parts": [p.__dict__ for p in group.parts]}
        passes, pos = [], 0
        for n, seed in json.loads(a.logits):
            ids = np.random.default_rng(seed).integers(3, runner.config.vocab_size, n)
            passes.append(ex.run(runner.contiguous_batch(ids, pos, logits_all=True)).copy())
            pos += n
        np.savez(os.path.join(out_dir, "logits.npz"), *passes)
        if ex.pipeline_groups > 1:    # the same passes under cross-step pipelining, each with a step of
            np.savez(os.path.join(out_dir, "logits_cross.npz"), *cross_step_passes(ex, json.loads(a.logits)))
        if a.prompts:
            prompts = json.load(open(a.prompts))
            out["greedy"] = (batched_greedy(ex, prompts, a.max_tokens) if a.runner_greedy
                             else greedy(ex, prompts, a.max_tokens, out))
        out["stats"] = group.stats()
        json.dump(out, open(os.path.join(out_dir, "result.json"), "w"))
    finally:
        ex.close()


def cross_step_passes(ex, passes):
    """The ``--logits`` passes again, each launched with a step of another sequence (random tokens, blocks at
    the end of the pool) behind it, so that two steps are in flight when the pass's logits come back."""
    runner = ex.runner
    rng = np.random.default_rng(99)
    lens = rng.integers(1, 40, len(passes)).tolist()
    need = -(-sum(lens) // runner.block_size)
    assert need + -(-sum(n for n, _ in passes) // runner.block_size) <= runner.num_blocks
    other = np.arange(runner.num_blocks - need, runner.num_blocks, dtype=np.int32)
    out, pos, opos = [], 0, 0
    for (n, seed), m in zip(passes, lens):
        ids = np.random.default_rng(seed).integers(3, runner.config.vocab_size, n)
        ex.launch(runner.contiguous_batch(ids, pos, logits_all=True))
        b = runner.contiguous_batch(rng.integers(3, runner.config.vocab_size, m), opos)
        b.block_tables = [other[:len(b.block_tables[0])]]
        ex.launch(b)
        out.append(ex.finish().copy())
        ex.finish()
        pos, opos = pos + n, opos + m
    return out


def greedy(ex, prompts, max_tokens, out=None):
    from pyengine.engine.llm_engine import LLMEngine
    from pyengine.sampling_params import SamplingParams
    eng = LLMEngine(executor=ex)              # the runner's own limits
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, params)
    done = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o.outputs[0].token_ids
    assert eng.num_used_blocks() == 0
    if out is not None:
        out["engine"] = {k: v for k, v in eng.stats().items() if isinstance(v, (int, float))}
    return [done[f"r{i}"] for i in range(len(prompts))]


def batched_greedy(ex, prompts, max_tokens):
    """Greedy continuations of token-id prompts decoded together on the runner (models without a tokenizer):
    one batch prefills them all, then each step decodes one token of every sequence."""
    from pyengine.engine.forward_batch import ForwardBatch
    bs = ex.runner.block_size
    seqs = [list(p) for p in prompts]
    per = -(-(max(map(len, seqs)) + max_tokens) // bs)
    tables = [np.arange(i * per, (i + 1) * per, dtype=np.int32) for i in range(len(seqs))]
    done = [0] * len(seqs)                   # tokens of each sequence already in the KV cache
    for _ in range(max_tokens):
        new = [s[d:] for s, d in zip(seqs, done)]
        ql = [len(n) for n in new]
        batch = ForwardBatch(np.concatenate(new).astype(np.int64),
                             np.concatenate([np.arange(d, d + q) for d, q in zip(done, ql)]).astype(np.int64),
                             ql, [d + q for d, q in zip(done, ql)], tables, np.cumsum(ql) - 1)
        nxt = ex.run(batch).argmax(-1)
        for i, t in enumerate(nxt.tolist()):
            done[i] += ql[i]
            seqs[i].append(t)
    return [s[len(p):] for s, p in zip(seqs, prompts)]


if __name__ == "__main__":
    sys.exit(main())
