"""Test doubles for the engine tests: a tiny tokenizer and a fake model runner that honours the
ForwardBatch contract.

The fake runner keeps a fake KV cache (token id and position per slot), writes every batch token into the
slot its block table names, then computes each wanted row's logits from the *whole context read back
through the block table*. Any paging, prefix-caching, chunking or preemption bug (wrong slot, stale
block, block shared while written, missing token) therefore changes the logits, and usually trips an
assertion first. `reference_greedy` computes the same function with no engine at all: the independent
reference the engine's outputs are compared with.
"""
from __future__ import annotations

import numpy as np

VOCAB = 48
EOS = 0
_CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTU"   # ids 1..47
assert len(_CHARS) == VOCAB - 1


class _Stream:
    def __init__(self, tok):
        self.tok = tok

    def push(self, tid):
        return self.tok.token_bytes(tid).decode()

    def flush(self):
        return ""


class FakeTokenizer:
    """One character per token (ids 1..47), id 0 = <eos> (special). Has what the real
    IncrementalDetokenizer and StopChecker use: decoder.stream(), check_id, special_ids."""
    vocab_size = VOCAB
    bos_token_id = None
    eos_token_id = EOS
    stop_token_ids = [EOS]
    special_ids = {EOS}
    add_bos_token = False

    @property
    def decoder(self):
        return self

    def stream(self):
        return _Stream(self)

    def check_id(self, tid):
        if not 0 <= int(tid) < VOCAB:
            raise ValueError(f"token id {tid} out of range")
        return int(tid)

    def encode(self, text, add_special_tokens=False, parse_special=True):
        return [_CHARS.index(c) + 1 for c in text]

    def token_bytes(self, tid):
        return b"<eos>" if tid == EOS else _CHARS[tid - 1].encode()

    def decode(self, ids, skip_special_tokens=False):
        return "".join("" if (t == EOS and skip_special_tokens) else self.token_bytes(t).decode() for t in ids)


class WideTokenizer(FakeTokenizer):
    """FakeTokenizer over the tiny model's whole vocabulary (ids shown as <n>); no stop token."""
    vocab_size, eos_token_id, stop_token_ids, special_ids = None, None, [], set()

    def check_id(self, tid):
        return int(tid)

    def token_bytes(self, tid):
        return f"<{tid}>".encode()


class FakeConfig:
    vocab_size = VOCAB
    n_params = 0                # unknown (a draft model's cost then defaults)


_MULT = np.uint64(0x9E3779B97F4A7C15)


def context_logits(context) -> np.ndarray:
    """Deterministic logits as a function of the full token context (order-sensitive hash -> Gaussian)."""
    ids = np.asarray(context, dtype=np.uint64) + np.uint64(1)
    powers = np.cumprod(np.full(len(ids), _MULT, dtype=np.uint64))   # wraps mod 2**64 on purpose
    h = int(np.sum(ids * powers, dtype=np.uint64)) ^ len(ids)
    logits = np.random.default_rng(h).standard_normal(VOCAB).astype(np.float32) * 2.0
    logits[EOS] -= 2.0                                  # stops happen, but not too often
    return logits


def reference_greedy(prompt: list[int], max_tokens: int, ignore_eos: bool = False) -> list[int]:
    """What greedy decoding of the fake model must produce, computed without any engine."""
    ctx = list(prompt)
    out = []
    while len(out) < max_tokens:
        t = int(np.argmax(context_logits(ctx)))
        out.append(t)
        ctx.append(t)
        if t == EOS and not ignore_eos:
            break
    return out


class FakeRunner:
    """`logits_fn(context ids) -> logits` and `tokenizer` may be replaced (a scripted model over a real
    vocabulary: tests/test_reasoning.py); by default the hashed-context model over the one-character vocabulary."""

    def __init__(self, num_blocks=64, block_size=4, max_num_batched_tokens=None, logits_fn=None, tokenizer=None):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.tokenizer = tokenizer or FakeTokenizer()
        self.config = FakeConfig()
        self.config.vocab_size = self.tokenizer.vocab_size
        self.logits_fn = logits_fn or context_logits
        self.gguf = None                   # no model file (the engine's model_metadata() is then None)
        self.graphs = self.expert_load = None   # no captured steps, no experts
        self.max_model_len = self.max_num_seqs = None   # the engine's limits are its own
        self.enforce_eager = False
        self.max_num_batched_tokens = max_num_batched_tokens
        n = num_blocks * block_size
        self.kv_tok = np.full(n, -1, dtype=np.int64)
        self.kv_pos = np.full(n, -1, dtype=np.int64)
        self.tokens_computed = 0
        self.calls = 0
        self.batches = []          # (query_lens, context_lens) per call, for scheduling assertions

    def slots(self, table, positions):
        bs = self.block_size
        positions = np.asarray(positions, dtype=np.int64)
        blocks = np.asarray(table, dtype=np.int64)[positions // bs]
        return blocks * bs + positions % bs

    def run(self, batch) -> np.ndarray:
        batch.validate(self.block_size, self.num_blocks, self.config.vocab_size)   # the real runner's own checks
        T = len(batch.token_ids)
        assert batch.token_ids.dtype == np.int64 and batch.positions.dtype == np.int64
        assert sum(batch.query_lens) == T == len(batch.positions)
        assert len(batch.query_lens) == len(batch.context_lens) == len(batch.block_tables)
        if self.max_num_batched_tokens is not None:
            assert T <= self.max_num_batched_tokens, f"batch of {T} tokens exceeds the budget"
        self.calls += 1
        self.tokens_computed += T
        self.batches.append((list(batch.query_lens), list(batch.context_lens)))
        starts = np.cumsum([0] + list(batch.query_lens))
        written = []
        for s, (q, c, table) in enumerate(zip(batch.query_lens, batch.context_lens, batch.block_tables)):
            assert table.dtype == np.int32
            assert q >= 1 and c >= q
            assert len(table) * self.block_size >= c, "block table does not cover the context"
            assert len(set(table.tolist())) == len(table), "a block appears twice in one table"
            pos = batch.positions[starts[s]:starts[s + 1]]
            assert np.array_equal(pos, np.arange(c - q, c)), "positions are not the sequence's next ones"
            sl = self.slots(table, pos)
            self.kv_tok[sl] = batch.token_ids[starts[s]:starts[s + 1]]
            self.kv_pos[sl] = pos
            written.append(set(table[(pos // self.block_size)].tolist()))
        for s, blocks in enumerate(written):       # a block being written must be private to its writer
            for o, table in enumerate(batch.block_tables):
                if o != s:
                    assert not blocks & set(table.tolist()), f"block written by seq {s} is in seq {o}'s table"
        rows = []
        for r in batch.logits_indices.tolist():
            s = int(np.searchsorted(starts, r, side="right") - 1)
            p = int(batch.positions[r])
            sl = self.slots(batch.block_tables[s], np.arange(p + 1))
            assert np.array_equal(self.kv_pos[sl], np.arange(p + 1)), "context slot holds a stale/missing token"
            rows.append(self.logits_fn(self.kv_tok[sl]))
        return np.stack(rows) if rows else np.zeros((0, self.config.vocab_size), np.float32)


def make_engine(num_blocks=64, block_size=4, **kw):
    from pyengine.engine.llm_engine import LLMEngine
    runner = FakeRunner(num_blocks, block_size, kw.get("max_num_batched_tokens"))
    kw.setdefault("max_model_len", 256)
    kw.setdefault("max_num_seqs", 8)
    kw.setdefault("max_num_batched_tokens", 64)
    return LLMEngine(runner=runner, **kw)


def run_all(engine, max_steps=100000, check=None):
    """Step until idle; returns {request_id: final RequestOutput} and checks the streamed deltas add up."""
    final, streamed = {}, {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            for c in out.outputs:
                key = (out.request_id, c.index)
                if key not in streamed:     # streams that began before this call are not checked
                    streamed[key] = "" if len(c.token_ids) == len(c.delta_token_ids) else None
                if streamed[key] is not None:
                    streamed[key] += c.delta_text
            if out.finished:
                final[out.request_id] = out
        if check is not None:
            check(engine)
    else:
        raise AssertionError("engine did not finish")
    for out in final.values():
        for c in out.outputs:
            got = streamed.get((out.request_id, c.index), "")
            assert got is None or got == c.text
    return final



class StepClock:
    """A fake clock for the S11 chunk budget: ``StepClock(engine)`` becomes the engine's clock and sits in front of
    its runner, so that every batch run "takes" ``cost(query_lens, context_lens)`` seconds, by default 20 ms +
    0.2 ms a token + 1 us a (query, key) pair: chunk sizes then follow the context, the same on every run."""

    def __init__(self, engine, cost=None):
        self.inner, self.t = engine.runner, 0.0
        self.cost = cost or (lambda q, c: 0.020 + 0.0002 * sum(q)
                             + 1e-6 * sum(n * (k - n) + n * (n + 1) / 2 for n, k in zip(q, c)))
        engine.runner, engine.clock = self, self

    def __getattr__(self, name):              # the rest of the runner's contract
        return getattr(self.inner, name)

    def run(self, batch):
        self.t += self.cost(list(batch.query_lens), list(batch.context_lens))
        return self.inner.run(batch)

    def __call__(self) -> float:
        return self.t
