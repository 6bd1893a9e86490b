"""S01/S04/S09: the output processor (vLLM v1's seam) — what a sampled token means for its request.

Per sequence: incremental detokenization and stop checking (stop strings and ids, EOS, max_tokens, the context
length), logprobs, the request's metrics, and each step's deltas, turned into `RequestOutput` snapshots (cumulative
text plus the new delta). The engine loop decides what runs; this decides what the client sees.
"""
from __future__ import annotations

from pyengine.engine.outputs import CompletionOutput, RequestOutput, snapshot_metrics
from pyengine.engine.stop_checker import StopChecker
from pyengine.structured.processor import grammar_outcome


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids: set[int], max_model_len: int):
        self.tokenizer, self.eos_token_ids, self.max_model_len = tokenizer, eos_token_ids, int(max_model_len)

    def add_sequence(self, req, params, max_tokens: int) -> None:
        """The state of a request's next sequence: its stop checker and logprobs."""
        req.checkers.append(StopChecker(self.tokenizer, params, self.eos_token_ids, max_tokens=max_tokens))
        req.logprobs.append([] if params.logprobs is not None else None)
        req.cumulative_logprob.append(0.0 if params.logprobs is not None else None)

    def on_token(self, seq, req, tok: int, info, now: float, deltas: dict):
        """``tok`` was appended to ``seq``: metrics, logprobs (``info``: its `TokenLogprobs` or None), stop checks,
        the step's delta of the sequence in ``deltas``. Returns the stop check's result when it ends the sequence
        (``finish_reason``, ``stop_reason``), else None."""
        m = req.metrics
        if m.first_token_time is None:
            m.first_token_time = now
        if not m.token_times or m.token_times[-1] != now:
            m.token_times.append(now)
        if info is not None:
            req.logprobs[seq.index].append(info.as_dict())
            req.cumulative_logprob[seq.index] += info.logprob
        checker = req.checkers[seq.index]
        res = checker.append(tok)
        if req.matchers is not None:            # S15: a failed grammar finishes its sequence ("error")
            res = grammar_outcome(req.matchers[seq.index], checker, res)
        delta = res.delta_text
        if not res.finished and seq.num_tokens >= self.max_model_len:
            res = checker.finish("length")
            delta += res.delta_text
        entry = deltas.setdefault(req.request_id, {}).setdefault(seq.index, [[], ""])
        entry[0].append(tok)      # a verification may emit several tokens in one step
        entry[1] += delta
        return res if res.finished else None

    def abort(self, req, seq) -> None:
        req.checkers[seq.index].finish("abort")
        seq.finish_reason = "abort"

    def make_output(self, req, deltas: dict[int, list]) -> RequestOutput:
        """The request's `RequestOutput` now: every sequence's text so far and this step's delta."""
        outs = []
        for seq, checker in zip(req.seqs, req.checkers):
            toks, delta = deltas.get(seq.index, ([], ""))
            lps = req.logprobs[seq.index]
            outs.append(CompletionOutput(
                index=seq.index, text=checker.text, token_ids=list(seq.output_token_ids),
                logprobs=list(lps) if lps is not None else None, finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason, delta_text=delta, delta_token_ids=list(toks),
                cumulative_logprob=req.cumulative_logprob[seq.index]))
        out = RequestOutput(req.request_id, req.prompt, list(req.prompt_token_ids), outs, req.finished,
                            snapshot_metrics(req.metrics))
        if req.prompt_state is not None:        # S19 (engine/prompt_logprobs.py): complete once the prompt ran
            out.prompt_logprobs = list(req.prompt_state.entries)
        if req.pool is not None and req.finished and req.pool.covered:
            out.pooled = req.pool.result()
        return out
