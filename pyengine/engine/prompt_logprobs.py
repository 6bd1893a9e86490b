"""S19: what a request asks of its prompt's own forward pass — prompt logprobs and pooled states (engine/pooling.py).

Prompt logprobs (vLLM's ``SamplingParams.prompt_logprobs``; OpenAI's ``echo`` + ``logprobs``): entry i of
`RequestOutput.prompt_logprobs` is {token id: `Logprob`} for prompt token i — its log-probability given tokens
< i, plus the top-k of that distribution — and entry 0 is None (nothing predicts the first token). They come from
the SAME forward as the prefill: after every step that runs a chunk of such a prompt, the model's head is applied
to the final hidden states of that chunk's positions (`HiddenStateRunner.prompt_logits`, read from the runner
before its next run), so chunked prefill gives each chunk's positions in its own step and no layer runs twice. The
head rows go through in slices of at most PROMPT_LOGITS_BYTES of logits (V floats a row: Gemma 3's 262k vocabulary
would need 2 GiB for a 2048-token chunk at once), each reduced to its logprobs before the next. Under S17 (an
executor of several ranks, engine/executor.py `PromptRowsExecutor`) the step's rows go with its plan
(`PromptRows`, ``PromptPass.ask``) and their values come back reduced (`PromptValues`: each rank's vocabulary
columns cut to `column_stats`, merged by `merge_stats`; parallel/prompt_rows.py); under S18 the prefill instance
computes them (`routed_params`).

Prefix caching: a cached block holds K/V, not logits, so such a request (its first sequence) bypasses the prefix
cache lookup and computes its whole prompt; its blocks are still cached for later requests. A preempted sequence
that recomputes its prompt does not report a position twice (``covered``).

With ``max_tokens=0`` a request only scores its prompt (lm-eval's loglikelihood): it ends after its prefill with
finish_reason "length" and no token is sampled.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pyengine.engine.executor import PromptRowsExecutor

PROMPT_LOGITS_BYTES = 64 << 20      # memory bound of one slice of prompt logits (rows x vocab x 4 bytes)


@dataclass
class Logprob:
    """vLLM's per-token record: the logprob, its rank in the distribution (1 = most likely) and, once the server
    decodes it, the token's text."""
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


def prompt_logprob_entries(logits: np.ndarray, next_ids: np.ndarray, k: int) -> list[dict[int, Logprob]]:
    """Per row of raw ``logits`` (m, V): {next id: its Logprob, and the top-k ids: theirs}, from the full
    log-softmax (the normalizer summed in float64; one float32 temporary of the slice's size), best first (ties by
    id)."""
    x = np.asarray(logits, dtype=np.float32)
    m = x.max(axis=1, keepdims=True)
    lse = m[:, 0].astype(np.float64) + np.log(np.exp(x - m).sum(axis=1, dtype=np.float64))
    out = []
    for r in range(x.shape[0]):
        row, tok = x[r], int(next_ids[r])
        entry: dict[int, Logprob] = {}
        if k > 0:
            n = min(k, row.shape[0])
            cand = np.argpartition(-row, n - 1)[:n]
            cand = cand[np.lexsort((cand, -row[cand]))]
            for rank, i in enumerate(cand.tolist(), 1):
                entry[i] = Logprob(float(row[i]) - lse[r], rank)
        if tok not in entry:
            rank = int(np.count_nonzero(row > row[tok])) + 1
            entry = {tok: Logprob(float(row[tok]) - lse[r], rank), **entry}
        out.append(entry)
    return out


@dataclass
class PromptRows:
    """S19 under S17: the rows of one step whose values are wanted (token rows of its batch): ``logprob_rows``
    with the ids they predict (``next_ids``) and the top ``k``, ``hidden_rows`` whose final states are pooled."""
    logprob_rows: np.ndarray
    next_ids: np.ndarray
    k: int
    hidden_rows: np.ndarray

    @property
    def rows(self) -> np.ndarray:
        """Every row wanted, logprob rows first (what a last pipeline stage sends back)."""
        return np.concatenate([self.logprob_rows, self.hidden_rows]).astype(np.int64)


@dataclass
class PromptValues:
    """What comes back for a step's `PromptRows`: per logprob row its entry (as `prompt_logprob_entries`), and
    the final (normed) states of the hidden rows, (len(hidden_rows), d)."""
    entries: list
    hidden: np.ndarray | None


def target_logits(cols: np.ndarray, v0: int, next_ids: np.ndarray) -> np.ndarray:
    """(m,) float32: each row's logit of its next id if this rank's columns [v0, v0 + width) hold it, else 0
    (summed over the ranks: every rank then has each row's target logit)."""
    t = np.zeros(len(cols), np.float32)
    local = np.asarray(next_ids, np.int64) - v0
    mine = np.nonzero((local >= 0) & (local < cols.shape[1]))[0]
    t[mine] = cols[mine, local[mine]]
    return t


def column_stats(cols: np.ndarray, v0: int, target: np.ndarray, k: int) -> np.ndarray:
    """(m, 3 + 2k) float64 of a rank's logit columns: max, sum of exp(x - max) (float64), how many exceed the
    row's ``target`` logit, its top-k ids and their logits (id -1 / -inf where it has fewer columns)."""
    x = np.asarray(cols, dtype=np.float32)
    m, width = x.shape
    out = np.full((m, 3 + 2 * k), -np.inf)
    out[:, 3:3 + k] = -1
    mx = x.max(axis=1, keepdims=True)
    out[:, 0] = mx[:, 0]
    out[:, 1] = np.exp(x - mx).sum(axis=1, dtype=np.float64)
    out[:, 2] = np.count_nonzero(x > target[:, None], axis=1)
    n = min(k, width)
    if n:
        top = np.argpartition(-x, n - 1, axis=1)[:, :n]
        out[:, 3:3 + n] = top + v0
        out[:, 3 + k:3 + k + n] = np.take_along_axis(x, top, axis=1)
    return out


def merge_stats(parts: list, target: np.ndarray, next_ids: np.ndarray, k: int) -> list[dict[int, Logprob]]:
    """The entries `prompt_logprob_entries` gives for whole rows, from every rank's `column_stats` of its
    columns: the normalizer from the ranks' maxima and sums, the top-k of their top-k's (best first, ties by id),
    the next id's rank from their counts."""
    st = np.stack(parts)                                   # (ranks, m, 3 + 2k)
    big = st[:, :, 0].max(axis=0)
    lse = big + np.log((st[:, :, 1] * np.exp(st[:, :, 0] - big)).sum(axis=0))
    ids = np.concatenate(list(st[:, :, 3:3 + k]), axis=1).astype(np.int64)
    vals = np.concatenate(list(st[:, :, 3 + k:]), axis=1)
    out = []
    for r in range(st.shape[1]):
        tok, entry = int(next_ids[r]), {}
        keep = ids[r] >= 0
        cand, cv = ids[r][keep], vals[r][keep]
        order = np.lexsort((cand, -cv))[:k]
        for rank, i in enumerate(order.tolist(), 1):
            entry[int(cand[i])] = Logprob(float(cv[i]) - lse[r], rank)
        if tok not in entry:
            entry = {tok: Logprob(float(target[r]) - lse[r], int(st[:, r, 2].sum()) + 1), **entry}
        out.append(entry)
    return out


class PromptState:
    """One request's prompt-logprob collection: entries so far (entry 0 None) and how many positions are done."""

    def __init__(self, k: int, prompt_token_ids: list[int]):
        self.k, self.ids = k, prompt_token_ids
        self.entries: list = [None]

    def positions(self, start: int, n: int) -> range:
        """Positions of a chunk [start, start + n) whose rows give prompt tokens not reported yet (position p's
        row predicts token p + 1)."""
        return range(max(start, len(self.entries) - 1), min(start + n, len(self.ids) - 1))


class PromptPass:
    """The extra rows of one step: ``rows`` (token rows of the batch whose prompt logprobs are wanted), ``hidden``
    (token rows whose hidden states are pooled), who gets them, and the scoring-only requests it ends."""

    def __init__(self):
        self.rows: list[int] = []
        self.logprob_parts: list[tuple] = []     # (PromptState, positions)
        self.hidden: list[int] = []
        self.pool_parts: list[tuple] = []        # (PoolState, positions, rows)
        self.scoring: list = []                  # (request, sequence) whose prompt ends in this step, no sampling

    @classmethod
    def plan(cls, scheduled, owner_of) -> "PromptPass | None":
        """The extra rows of a step scheduling ``scheduled`` ((sequence, n) in batch order; ``owner_of``:
        sequence -> its request); None if no request asks for any."""
        p, offset = None, 0
        for seq, n in scheduled:
            req = owner_of(seq)
            if seq.index == 0 and (req.prompt_state is not None or req.pool is not None):
                start = seq.num_computed_tokens
                p = p or cls()
                if req.prompt_state is not None:
                    pos = req.prompt_state.positions(start, n)
                    if len(pos):
                        p.rows.extend(offset + q - start for q in pos)
                        p.logprob_parts.append((req.prompt_state, pos))
                if req.pool is not None:
                    pos = req.pool.positions(start, n)
                    if len(pos):
                        rows = [offset + q - start for q in pos]
                        p.hidden.extend(rows)
                        p.pool_parts.append((req.pool, pos, len(rows)))
            if req.score_only and seq.num_computed_tokens + n == seq.num_tokens:
                p = p or cls()
                p.scoring.append((req, seq))
            offset += n
        return p

    def ask(self, executor) -> None:
        """S19 under S17: before the step runs, tell an executor of several ranks which rows it brings back."""
        if (self.rows or self.hidden) and isinstance(executor, PromptRowsExecutor):
            next_ids = np.concatenate([np.asarray(s.ids[p.start + 1:p.stop + 1], np.int64)
                                       for s, p in self.logprob_parts]) if self.rows else np.zeros(0, np.int64)
            executor.ask_rows(PromptRows(np.asarray(self.rows, np.int64), next_ids,
                                         max((s.k for s, _ in self.logprob_parts), default=0),
                                         np.asarray(self.hidden, np.int64)))

    def take(self, executor, vocab_size: int) -> None:
        """Prompt logprobs and pooled states of the step ``executor`` ran last (read before its next run): from
        its runner, or (several ranks) what its ranks reduced and brought back."""
        if isinstance(executor, PromptRowsExecutor):
            got = executor.rows_back() if (self.rows or self.hidden) else None
            if got is not None:
                self._deliver(got.entries, got.hidden)
            return
        self._take_local(executor.runner, vocab_size)

    def _deliver(self, entries: list, hidden) -> None:
        owners = [s for s, p in self.logprob_parts for _ in p]
        next_ids = [s.ids[q + 1] for s, p in self.logprob_parts for q in p]
        for state, tok, entry in zip(owners, next_ids, entries):
            state.entries.append({t: e for t, e in entry.items() if e.rank <= state.k or t == tok})
        at = 0
        for pool, pos, count in self.pool_parts:
            pool.add(pos, hidden[at:at + count])
            at += count

    def _take_local(self, runner, vocab_size: int) -> None:
        if self.rows:
            next_ids = np.concatenate([np.asarray(s.ids[p.start + 1:p.stop + 1]) for s, p in self.logprob_parts])
            owners = [s for s, p in self.logprob_parts for _ in p]
            for at, logits in runner.prompt_logits(np.asarray(self.rows, dtype=np.int64),
                                                   max(1, PROMPT_LOGITS_BYTES // (4 * vocab_size))):
                m = len(logits)
                k = max(s.k for s in owners[at:at + m])       # a slice shared by requests: the largest k, then
                for r, entry in enumerate(prompt_logprob_entries(logits, next_ids[at:at + m], k)):   # each its own
                    state = owners[at + r]
                    if state.k < k:
                        entry = {t: e for t, e in entry.items() if e.rank <= state.k or t == int(next_ids[at + r])}
                    state.entries.append(entry)
        if self.hidden:
            states = runner.hidden_states(np.asarray(self.hidden, dtype=np.int64))
            at = 0
            for pool, pos, count in self.pool_parts:
                pool.add(pos, states[at:at + count])
                at += count


# --- the engine's hooks (LLMEngine.add_request, ._complete) --------------------------------------------------------
def pooling_of(engine, params):
    """(PoolingParams or None, the SamplingParams the request runs with). A pooling request runs greedy with no
    sampled token; ValueError if this engine cannot return hidden states or ``dimensions`` is not its width."""
    from pyengine.engine.pooling import PoolingParams
    from pyengine.sampling_params import SamplingParams
    if not isinstance(params, PoolingParams):
        if params.prompt_logprobs is not None:
            local_runner(engine, "prompt_logprobs")
        return None, params
    params.check(int(local_runner(engine, "embeddings").config.d_model))
    return params, SamplingParams(max_tokens=1, temperature=0.0)


def local_runner(engine, what: str):
    """The engine's runner if it can return hidden states and head rows of its latest run, else ValueError."""
    from pyengine.engine.pooling import HiddenStateRunner
    runner = engine.runner
    if isinstance(engine.executor, PromptRowsExecutor):   # several ranks: they bring the values back (S17)
        return runner
    if not isinstance(runner, HiddenStateRunner) or engine.executor.group is not None:
        raise ValueError(f"{what} need one local model runner or an executor of several ranks that brings them "
                         f"back (not this engine's runner)")
    return runner


def init_request(req, params, pooling, max_tokens: int) -> None:
    """Set a new request's S19 state: prompt logprobs, pooled state, scoring only (max_tokens 0)."""
    from pyengine.engine.pooling import PoolState
    if params.prompt_logprobs is not None:
        req.prompt_state = PromptState(params.prompt_logprobs, req.prompt_token_ids)
    if pooling is not None:
        req.pool = PoolState(pooling, len(req.prompt_token_ids))
    req.score_only = max_tokens == 0
    if req.score_only and params.n > 1:
        raise ValueError("max_tokens=0 (scoring the prompt) takes n=1")


def finish_scoring(engine, scoring, deltas: dict) -> None:
    """End the scoring-only sequences whose prompt ran to its end in this step: finish_reason "length"."""
    import time
    now = time.monotonic()
    for req, seq in scoring:
        if seq.is_finished or req.request_id not in engine.requests:      # aborted meanwhile
            continue
        req.checkers[seq.index].finish("length")
        seq.finish_reason = "length"
        engine._finish(seq)
        deltas.setdefault(req.request_id, {}).setdefault(seq.index, [[], ""])
        if req.finished:
            req.metrics.finished_time = now


def routed_params(params, hidden_size: int):
    """S18's router: (the SamplingParams its checks see, the request's sequences) of what a client sent. An
    embedding request (`PoolingParams`) is checked as an engine would (``dimensions`` against the model's
    ``hidden_size``) and routed as a one-sequence prefill-only request: a prefill instance pools it and its
    output ends the request. Prompt logprobs are computed by the prefill instance in the prompt's own forward
    and come with its first output (`decode_params` leaves them out on the decode side)."""
    from pyengine.engine.pooling import PoolingParams
    from pyengine.sampling_params import SamplingParams
    if isinstance(params, PoolingParams):
        params.check(int(hidden_size))
        return SamplingParams(max_tokens=1, temperature=0.0), 1
    return params, params.n


def decode_params(params):
    """S18's decode instance: the params it adopts a prefilled request with. The prefill instance reported the
    prompt logprobs with its first output; here they are not asked again (an empty list would replace them)."""
    from dataclasses import replace
    return params if params.prompt_logprobs is None else replace(params, prompt_logprobs=None)
