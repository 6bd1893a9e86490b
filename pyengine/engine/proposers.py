"""S14: drafters. A proposer guesses the next k tokens of a sequence cheaply; the model then checks them all in
one forward pass (see `pyengine/layers/rejection_sampler.py`).

Every proposer has one method, ``propose(seqs, ks, rngs) -> [(draft ids, draft probabilities or None)]``:
for each sequence at most ``ks[i]`` ids, and either the (len, V) distributions q the ids were drawn from or None
when the ids are certain guesses (q one-hot). ``free`` says whether proposing costs a forward pass (the
engine's back-off only probes an expensive proposer now and then). ``release(seq)`` forgets a sequence.

- `NgramProposer` (prompt lookup): the last n tokens of the sequence, n from ``prompt_lookup_max`` down to
  ``prompt_lookup_min``, are searched for earlier in its own prompt and output; what followed the latest
  earlier occurrence is the guess. No model, no state: it shines when the output repeats its input (code
  edits, summaries quoting the passage).
"""
from __future__ import annotations

from typing import Callable, Protocol, runtime_checkable

import numpy as np


def ngram_lookup(tokens: np.ndarray, k: int, n_min: int, n_max: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest matching suffix
    (of n_max..n_min tokens) of ``tokens``; [] if none matches."""
    L = len(tokens)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        pattern = tokens[L - n:]
        # windows starting at 0..L-n-1 (each followed by at least one token): all n positions must agree
        hit = tokens[:L - n] == pattern[0]
        for j in range(1, n):
            hit &= tokens[j:L - n + j] == pattern[j]
        starts = np.flatnonzero(hit)
        if starts.size:
            s = int(starts[-1]) + n
            return tokens[s:s + k].tolist()
    return []


class NgramIndex:
    """``ngram_lookup`` kept up to date as a sequence grows: for each n, the latest start of every n-gram that
    is followed by at least one token. Appending a token indexes the n-grams ending just before it, so a lookup
    costs a few dictionary reads instead of a scan of the whole sequence each step (at 8 sequences the scans
    were ~4% of a plain decode step's time; docs/performance.md)."""

    def __init__(self, n_min: int, n_max: int):
        self.n_min, self.n_max = n_min, n_max
        self.tokens: list[int] = []
        self.latest: dict[tuple, int] = {}          # n-gram (any n) -> its latest start

    def extend(self, token_ids) -> None:
        t = self.tokens
        if len(token_ids) < len(t) or (t and token_ids[len(t) - 1] != t[-1]):   # not a continuation: start over
            t.clear()
            self.latest.clear()
        for tok in token_ids[len(t):]:
            end = len(t)                            # the n-grams ending at end - 1 are now followed by tok
            for n in range(self.n_min, min(self.n_max, end) + 1):
                self.latest[tuple(t[end - n:end])] = end - n
            t.append(tok)

    def lookup(self, k: int) -> list[int]:
        t, L = self.tokens, len(self.tokens)
        for n in range(min(self.n_max, L - 1), self.n_min - 1, -1):
            s = self.latest.get(tuple(t[L - n:]))
            if s is not None:
                return t[s + n:s + n + k]
        return []


class NgramProposer:
    free = True
    relative_cost = 0.0         # lookups cost nothing next to a target step

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int):
        self.n_min, self.n_max = prompt_lookup_min, prompt_lookup_max
        self.index: dict[int, NgramIndex] = {}      # seq_id -> its n-gram index

    def propose(self, seqs, ks, rngs=None) -> list[tuple[list[int], None]]:
        out = []
        for seq, k in zip(seqs, ks):
            ix = self.index.get(seq.seq_id)
            if ix is None:
                ix = self.index[seq.seq_id] = NgramIndex(self.n_min, self.n_max)
            ix.extend(seq.token_ids)
            out.append((ix.lookup(k) if k else [], None))
        return out

    def release(self, seq) -> None:
        self.index.pop(seq.seq_id, None)


class _DraftState:
    """One target sequence as the draft model sees it: the tokens whose K/V its cache holds, and a
    `Sequence` that carries the draft cache's block table for the draft's own `BlockManager`."""

    def __init__(self, seq):
        from pyengine.engine.sequence import Sequence
        self.shadow = Sequence(seq.seq_id, seq.request_id, seq.index, seq.prompt_token_ids)
        self.cached: list[int] = []          # tokens with K/V in the draft cache, positions 0..len-1


def check_same_vocabulary(draft_runner, target_runner) -> None:
    """ValueError unless the draft model's vocabulary is the target's (same size, same token strings)."""
    dv, tv = draft_runner.config.vocab_size, target_runner.config.vocab_size
    if dv != tv:
        raise ValueError(f"draft model vocabulary has {dv} tokens, the target's has {tv}: speculative decoding "
                         "needs the same tokenizer")
    dg, tg = draft_runner.gguf, target_runner.gguf
    if dg is not None and tg is not None:
        dt, tt = dg.get("tokenizer.ggml.tokens"), tg.get("tokenizer.ggml.tokens")
        if dt is not None and tt is not None and list(dt) != list(tt):
            i = next(i for i, (a, b) in enumerate(zip(dt, tt)) if a != b)
            raise ValueError(f"draft model vocabulary differs from the target's at token {i} "
                             f"({dt[i]!r} vs {tt[i]!r}): speculative decoding needs the same tokenizer")


class DraftModelProposer:
    """A smaller model with the target's vocabulary drafts k tokens autoregressively, all sequences batched.

    It has its own `ModelRunner` (weights, arena, paged KV cache) and its own `BlockManager`. Each round it
    first catches a sequence's draft cache up with the target's tokens (the longest common prefix of what it
    cached and what the sequence now holds is kept: rejected drafts roll back for free), in one ragged
    prefill over all sequences, then runs k-1 batched one-token decodes. Greedy requests get the draft's
    argmax; sampled ones a draw from the draft's distribution after the request's own processors, returned as
    q for the rejection sampler; a constrained sequence's (S15, ``seq.spec_grammar``) after its grammar's mask
    too. A sequence the draft cache has no room for gets no draft that step.
    """
    free = False

    def __init__(self, model, target_runner, *, max_model_len: int, num_speculative_tokens: int,
                 draft_runner=None, max_num_seqs: int = 64):
        from pyengine.engine.block_manager import BlockManager
        if draft_runner is None:
            from pyengine.engine.model_runner import ModelRunner
            if isinstance(model, str):
                from pyengine.model_files import resolve_model
                model = resolve_model(model)
            draft_runner = ModelRunner(model, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                                       max_num_batched_tokens=max(2048, max_num_seqs),
                                       max_logits=max_num_seqs)
        if target_runner is not None:
            check_same_vocabulary(draft_runner, target_runner)
        self.runner = draft_runner
        # cost of one draft token in target decode steps, until measured: the ratio of the weights read
        d, t = (r.config.n_params if r is not None else 0 for r in (draft_runner, target_runner))
        self.relative_cost = d / t if d and t else 0.5
        self.bm = BlockManager(draft_runner.num_blocks, draft_runner.block_size, enable_prefix_caching=False)
        self.budget = draft_runner.max_num_batched_tokens or 2048
        self.states: dict[int, _DraftState] = {}

    def release(self, seq) -> None:
        st = self.states.pop(seq.seq_id, None)
        if st is not None:
            self.bm.free(st.shadow)

    def _forward(self, items):
        """One draft forward: items are (state, tokens, want_logits). Returns the logits rows of those
        that want them, in order."""
        from pyengine.engine.forward_batch import ForwardBatch
        ids, pos, qlens, clens, tables, rows = [], [], [], [], [], []
        for st, toks, want in items:
            start = len(st.cached)
            sh = st.shadow
            sh.num_computed_tokens = start
            self.bm.append_slots(sh, len(toks))
            ids.extend(toks)
            pos.extend(range(start, start + len(toks)))
            qlens.append(len(toks))
            clens.append(start + len(toks))
            tables.append(np.asarray(sh.block_table, dtype=np.int32))
            if want:
                rows.append(len(ids) - 1)
            st.cached.extend(toks)
            sh.num_computed_tokens = len(st.cached)
        batch = ForwardBatch(np.asarray(ids, dtype=np.int64), np.asarray(pos, dtype=np.int64), qlens, clens,
                             tables, np.asarray(rows, dtype=np.int64))
        return self.runner.run(batch)

    def _roll_back(self, seq, st: _DraftState) -> list[int]:
        """Keep the draft cache's longest prefix that agrees with ``seq``; return the tokens to catch up."""
        toks = seq.token_ids
        n = min(len(st.cached), len(toks) - 1)          # the last token is always fed again (its logits)
        if n:
            a = np.asarray(st.cached[:n])
            diff = np.flatnonzero(a != np.asarray(toks[:n]))
            n = int(diff[0]) if diff.size else n
        del st.cached[n:]
        st.shadow.num_computed_tokens = n
        self.bm.trim(st.shadow, n)
        st.shadow._token_ids = list(toks)               # the draft block manager sizes runs by num_tokens
        return toks[n:]

    def propose(self, seqs, ks, rngs=None):
        from pyengine.layers.rejection_sampler import peek_uniform, target_distribution
        from pyengine.layers.sampler import apply_allowed_mask, law_draw, process_logits

        rngs = rngs or [None] * len(seqs)
        out: list = [([], None)] * len(seqs)
        live = []                                      # (index, state, tokens still to feed)
        free = self.bm.num_free_blocks()
        for i, (seq, k) in enumerate(zip(seqs, ks)):
            if k <= 0:
                continue
            st = self.states.get(seq.seq_id)
            if st is None:
                st = self.states[seq.seq_id] = _DraftState(seq)
            todo = self._roll_back(seq, st)
            # this round feeds the missing tokens and k - 1 drafts
            need = self.bm.blocks_for(len(st.cached) + len(todo) + k - 1) - len(st.shadow.block_table)
            if need > free:                            # the draft cache is full: no draft this step
                continue
            free -= need
            live.append((i, st, todo))
        drafts = {i: [] for i, _, _ in live}
        probs = {i: [] for i, _, _ in live}

        def choose(i, row):
            seq, rng = seqs[i], rngs[i]
            p = seq.params
            output = list(seq.output_token_ids) + drafts[i]
            grammar = seq.spec_grammar
            if grammar is not None:            # S15: guess only what the grammar allows (q is the masked draft)
                row = apply_allowed_mask(row, grammar.mask_after(drafts[i]))
            if p.greedy:
                x = row if not (p.logit_bias or p.has_penalties) else process_logits(
                    row, p, seq.prompt_token_ids, output)
                t = int(np.argmax(x))
            else:
                q = target_distribution(row, p, seq.prompt_token_ids, output)
                if p.seed is not None:
                    # the sampling law: guess with the uniform the target's row will draw with, walking q in
                    # id order, and hand the guess over without q (coupled verification, docs/sampling.md);
                    # the stream is not consumed, so the seeded text never depends on the drafts
                    t = law_draw(q, peek_uniform(rng, len(drafts[i])))
                else:
                    t = int(rng.choice(len(q), p=q / q.sum()))
                    probs[i].append(q)
            drafts[i].append(t)
            return t

        # catch-up prefill, split over forwards when it exceeds the draft's token budget
        pending = [(i, st, list(todo)) for i, st, todo in live]
        while pending:
            items, budget, done = [], self.budget, []
            for i, st, todo in pending:
                if budget <= 0:
                    break
                take = todo[:budget]
                del todo[:len(take)]
                budget -= len(take)
                items.append((st, take, not todo))
                if not todo:
                    done.append(i)
            logits = self._forward(items)
            for i, row in zip(done, logits):
                choose(i, row)
            pending = [x for x in pending if x[2]]
        # k - 1 batched autoregressive steps
        for step in range(1, max(ks, default=0)):
            active = [(i, st) for i, st, _ in live if len(drafts[i]) < ks[i]]
            if not active:
                break
            logits = self._forward([(st, [drafts[i][-1]], True) for i, st in active])
            for (i, _), row in zip(active, logits):
                choose(i, row)
        for i, _, _ in live:
            out[i] = (drafts[i], np.stack(probs[i]) if probs[i] else None)
        return out


@runtime_checkable
class Proposer(Protocol):
    """What the speculative decoder asks of a drafter (see the module docstring). ``relative_cost``: one draft
    token's cost in target decode steps, until measured (0: free)."""
    free: bool
    relative_cost: float

    def propose(self, seqs, ks, rngs=None) -> list[tuple[list[int], np.ndarray | None]]: ...

    def release(self, seq) -> None: ...


def _ngram(cfg, target_runner, max_model_len: int, **draft_kw) -> Proposer:
    return NgramProposer(cfg.prompt_lookup_min, cfg.prompt_lookup_max)


def _draft_model(cfg, target_runner, max_model_len: int, **draft_kw) -> Proposer:
    return DraftModelProposer(cfg.model, target_runner, max_model_len=max_model_len,
                              num_speculative_tokens=cfg.num_speculative_tokens, **draft_kw)


# speculative_config's "method" -> the factory of its proposer (cfg: a SpeculativeConfig)
PROPOSERS: dict[str, Callable[..., Proposer]] = {"ngram": _ngram, "draft_model": _draft_model}


def make_proposer(cfg, target_runner=None, max_model_len: int = 2048, **draft_kw) -> Proposer:
    """The proposer of ``cfg.method`` from the registry (ValueError naming the known methods)."""
    factory = PROPOSERS.get(cfg.method)
    if factory is None:
        raise ValueError(f"speculative_config method must be one of {tuple(PROPOSERS)}, got {cfg.method!r}")
    return factory(cfg, target_runner, max_model_len, **draft_kw)
