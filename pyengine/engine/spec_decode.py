"""S14 speculative decoding: the engine's side (configuration, per-sequence draft length, back-off, counters).

Decoding one token reads every weight once; scoring k+1 tokens of a sequence in one pass costs little more,
because the weights still dominate. So each step a proposer (`pyengine/engine/proposers.py`) guesses k
tokens for every decoding sequence, the engine runs them as a (k+1)-token query in the same ragged batch as
everything else (logits at each of the k+1 rows), and `pyengine/layers/rejection_sampler.py` keeps the
longest acceptable prefix plus one token of the model's own. The KV slots of rejected drafts are rolled
back (`BlockManager.trim`), so they are never read or published to the prefix cache.

Back-off: a draft only pays when it is accepted often enough to cover what it costs. Each sequence keeps an
estimate ``alpha`` of its per-token acceptance (an exponential average over the drafts it had verified, and,
for a free proposer, over the guesses it would have made while not speculating); its j-th draft token is
worth ``alpha^j`` expected tokens. The sequences of a step share its cost, so the draft lengths are chosen for
the batch: for each level m of drafts per sequence the step would take the m * B most promising draft tokens
of its B sequences, and it keeps the level with the most expected tokens per unit of cost,
``(B + sum of their alpha^j) / (B * cost(m))``, if that beats plain decoding by MIN_GAIN. ``cost(m)`` is
measured as the engine runs: the whole-step CPU time (propose + forward + verify) of decode steps with m drafts
per sequence (rounded up), over that of plain steps with as many sequences (a plain step is forced now and then
to keep that baseline fresh). Each time is a slowly rising minimum of its samples (a shared host only ever adds
delays), and one not re-measured for REMEASURE_AFTER steps is taken halfway back to its prior, so one unlucky
sample cannot rule a level out for good. A level not measured is priced by the cheapest measured cost per
draft of the same batch size, or, before any, optimistically at ``1 + (PRIOR_COST + r) * m``, r being the
proposer's cost per draft token in target decode steps (0 for n-gram lookup, the weight ratio for a draft
model), so that each level is tried while acceptance is good. An expensive proposer backed off to no drafts
probes with one draft now and then, but only when perfect drafts could pay at all. The constants are measured
ones and live in pyengine/tuning.py (evidence in docs/performance.md).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pyengine import tuning
from pyengine.engine.proposers import make_proposer      # the registry of proposers by method

METHODS = ("ngram", "draft_model")
NGRAM_SHORTHAND_K = 4           # `--speculative-config ngram`: the drafts a step of the README's example
# the back-off's measured constants (PRIOR_COST, ALPHA_PRIOR, ALPHA_WEIGHT, TIME_DRIFT, REMEASURE_AFTER,
# PROBE_GAP, PROBE_GAP_MAX, MIN_GAIN, PROBE_MIN_GAIN, BASELINE_EVERY) live in pyengine/tuning.py


@dataclass
class SpeculativeConfig:
    """vLLM's ``speculative_config`` names: method, num_speculative_tokens, prompt_lookup_min/max, model."""
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    model: object = None           # draft_model: GGUF path, bytes or GGUFFile with the target's vocabulary
    adaptive: bool = True          # extension: back off when acceptance is too low to pay (see module doc)

    @classmethod
    def from_dict(cls, d) -> "SpeculativeConfig":
        if isinstance(d, SpeculativeConfig):
            return d
        if not isinstance(d, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(d).__name__}")
        known = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model", "adaptive"}
        extra = sorted(set(d) - known)
        if extra:
            raise ValueError(f"speculative_config: unknown key(s) {extra}; known: {sorted(known)}")
        method = d.get("method", "draft_model" if d.get("model") is not None else None)
        if method not in METHODS:
            raise ValueError(f"speculative_config method must be one of {METHODS}, got {method!r}")
        k = d.get("num_speculative_tokens")
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= 16:
            raise ValueError(f"speculative_config num_speculative_tokens must be an integer in [1, 16], got {k!r}")
        lo, hi = d.get("prompt_lookup_min"), d.get("prompt_lookup_max")
        if lo is None and hi is None:
            lo, hi = cls.prompt_lookup_min, cls.prompt_lookup_max
        lo = hi if lo is None else lo
        hi = lo if hi is None else hi
        for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"speculative_config {name} must be a positive integer, got {v!r}")
        if lo > hi:
            raise ValueError(f"speculative_config prompt_lookup_min ({lo}) > prompt_lookup_max ({hi})")
        model = d.get("model")
        if method == "draft_model" and model is None:
            raise ValueError("speculative_config method 'draft_model' needs 'model' (a GGUF path)")
        if method == "ngram" and model is not None:
            raise ValueError("speculative_config method 'ngram' takes no 'model'")
        adaptive = d.get("adaptive", True)
        if not isinstance(adaptive, bool):
            raise ValueError(f"speculative_config adaptive must be a bool, got {adaptive!r}")
        return cls(method, k, lo, hi, model, adaptive)


def parse_speculative_config(text: str | None) -> dict | None:
    """The ``--speculative-config`` command-line value, validated (ValueError naming the problem): vLLM's JSON
    dict, or the shorthand ``ngram`` / ``ngram:K`` (prompt lookup, K drafts a step, default NGRAM_SHORTHAND_K)."""
    if text is None:
        return None
    import json
    import re
    m = re.fullmatch(r"\s*ngram(?::(\d+))?\s*", text)
    if m:
        d = {"method": "ngram", "num_speculative_tokens": int(m.group(1) or NGRAM_SHORTHAND_K)}
    else:
        try:
            d = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--speculative-config is not valid JSON ({exc.msg}) nor ngram[:K]: {text!r}"
                             ) from None
    SpeculativeConfig.from_dict(d)
    return d


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens one verification emits on average with k drafts each accepted with probability alpha."""
    return float(sum(alpha ** i for i in range(k + 1)))


def _bucket(num_seqs: int) -> int:
    return min(num_seqs.bit_length(), 6)        # 1, 2-3, 4-7, ..., 32+


class SpeculativeDecoder:
    """Owns the proposer; chooses each sequence's draft length; counts drafts (vLLM's metric names)."""

    def __init__(self, config: SpeculativeConfig, proposer, max_model_len: int):
        self.config = config
        self.proposer = proposer
        self.max_model_len = max_model_len
        self.num_drafts = 0                  # verifications with at least one draft token
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_position = [0] * config.num_speculative_tokens
        self._time: dict[tuple[int, int], float] = {}   # (batch-size bucket, drafts per sequence) -> seconds
        self._measured: dict[tuple[int, int], int] = {}  # ... -> step of its last sample
        self.relative_cost = float(proposer.relative_cost)
        self._steps = 0

    # choosing k ---------------------------------------------------------------------------------
    def room(self, seq) -> int:
        """Drafts this sequence can take: the step emits at most k+1 tokens, and k+1 positions must fit."""
        K = self.config.num_speculative_tokens
        left = seq.max_tokens - seq.num_output_tokens - 1 if seq.max_tokens is not None else K
        return max(0, min(K, left, self.max_model_len - seq.num_tokens))

    def _cost(self, b: int, m: int, base: float, slope: float) -> float:
        """A step whose decodes carry m drafts each (rounded up), in plain steps of the same batch size."""
        prior = 1.0 + slope * m
        t = self._time.get((b, m))
        if t is None:
            return prior
        cost = t / base
        if self._steps - self._measured[(b, m)] > tuning.REMEASURE_AFTER:
            cost = (cost + prior) / 2
        return cost

    def draft_lens(self, seqs: list, available: list[int] | None = None) -> list[int]:
        """Each sequence's draft length this step, chosen for the batch as a whole.

        The sequences share the step: its cost depends on the drafts in all (measured per drafts per
        sequence, rounded up), while each sequence's j-th draft adds alpha^j expected tokens of its own. So for
        every level m = drafts per sequence the step takes the m * B most promising draft tokens of the batch
        (the largest alpha_i^j: a prefix of each sequence's drafts), and the level with the most expected
        tokens per unit of cost wins if it beats plain decoding by MIN_GAIN: a few sequences with good
        drafts do not make the whole batch pay for drafts that the others would waste."""
        rooms = [self.room(s) for s in seqs]
        if available is not None:             # the guesses a free proposer already made (its lookup may
            rooms = [min(r, a) for r, a in zip(rooms, available)]        # have found fewer than the room)
        if not self.config.adaptive:
            return rooms
        B = len(seqs)
        b = _bucket(B)
        base = self._time.get((b, 0))
        if base is None or self._steps % tuning.BASELINE_EVERY == 0 or not any(rooms):
            return [0] * B                    # measure what a plain step costs first
        # an unmeasured level is priced by the cheapest measured cost per draft of this batch size, or by the
        # optimistic prior before any measurement
        slopes = [(t / base - 1.0) / j for (bb, j), t in self._time.items() if bb == b and j > 0]
        slope = max(min(slopes), 0.0) if slopes else tuning.PRIOR_COST + self.relative_cost
        # every candidate draft token, best first: (gain, position in its sequence, sequence)
        cands = sorted(((s.spec_alpha ** j, -j, i) for i, s in enumerate(seqs) for j in range(1, rooms[i] + 1)),
                       reverse=True)
        gains = np.cumsum([c[0] for c in cands])
        best, best_n, best_perfect = tuning.MIN_GAIN, 0, 0.0
        for m in range(1, max(rooms) + 1):
            n = min(m * B, len(cands))
            if n <= (m - 1) * B:
                break
            cost = self._cost(b, m, base, slope)
            rate = (B + float(gains[n - 1])) / (B * cost)
            best_perfect = max(best_perfect, (B + n) / (B * cost))
            if rate > best:
                best, best_n = rate, n
        ks = [0] * B
        for _, _, i in cands[:best_n]:
            ks[i] += 1
        if best_n == 0 and not self.proposer.free and best_perfect > tuning.PROBE_MIN_GAIN:
            for i, seq in enumerate(seqs):
                # probe now and then: the only way to notice that acceptance has risen
                if seq.spec_probe_at is None:
                    seq.spec_probe_at = self._steps + seq.spec_probe_gap
                elif self._steps >= seq.spec_probe_at:
                    seq.spec_probe_gap = min(2 * seq.spec_probe_gap, tuning.PROBE_GAP_MAX)
                    seq.spec_probe_at = None
                    ks[i] = 1
        else:
            for i, seq in enumerate(seqs):
                if ks[i]:
                    seq.spec_probe_gap, seq.spec_probe_at = tuning.PROBE_GAP, None
        return ks

    def propose(self, seqs: list, rngs: list) -> None:
        """Set ``spec_token_ids`` / ``spec_draft_probs`` on each decoding sequence (``seqs`` all want a draft)."""
        self._steps += 1
        for seq in seqs:
            self._score_shadow(seq)
        if self.proposer.free and self.config.adaptive:
            # a free proposer guesses for everyone first: the choice then counts only the guesses that exist
            # (a sequence with no n-gram match has nothing to draft), and backed-off sequences keep theirs as
            # a shadow to learn from
            K = self.config.num_speculative_tokens
            drafts = self.proposer.propose(seqs, [max(0, min(K, self.max_model_len - s.num_tokens)) for s in seqs],
                                           rngs)
            ks = self.draft_lens(seqs, [len(ids) for ids, _ in drafts])
        else:
            ks = self.draft_lens(seqs)
            drafts = self.proposer.propose(seqs, ks, rngs) if any(ks) else [([], None)] * len(seqs)
        for seq, k, (ids, probs) in zip(seqs, ks, drafts):
            if k == 0:
                seq.spec_token_ids, seq.spec_draft_probs = [], None
                seq.spec_shadow = (seq.num_tokens, ids[:1]) if ids else None
            else:
                seq.spec_token_ids = list(ids[:k])
                seq.spec_draft_probs = None if probs is None else probs[:len(seq.spec_token_ids)]

    def _score_shadow(self, seq) -> None:
        """A guess made while not speculating, checked against the token the model then produced."""
        shadow = seq.spec_shadow
        seq.spec_shadow = None
        if shadow is None or seq.num_tokens <= shadow[0]:
            return
        at, ids = shadow
        self._trial(seq, seq.token_ids[at] == ids[0])

    @staticmethod
    def _trial(seq, accepted: bool) -> None:
        seq.spec_alpha += tuning.ALPHA_WEIGHT * (float(accepted) - seq.spec_alpha)

    # after verification -------------------------------------------------------------------------
    def record(self, seq, num_draft: int, num_accepted: int) -> None:
        """One verification of ``num_draft`` tokens of which the first ``num_accepted`` were accepted."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1
        for _ in range(num_accepted):
            self._trial(seq, True)
        if num_accepted < num_draft:
            self._trial(seq, False)

    def observe_step(self, seconds: float, num_decodes: int, num_draft_tokens: int) -> None:
        """CPU time of one whole step (propose + forward + verify) of ``num_decodes`` decodes and no prefill,
        with ``num_draft_tokens`` drafts among them (keyed by drafts per sequence, rounded up)."""
        if num_decodes <= 0:
            return
        key = (_bucket(num_decodes), -(-num_draft_tokens // num_decodes))
        old = self._time.get(key)
        self._time[key] = seconds if old is None else min(seconds, old * (1.0 + tuning.TIME_DRIFT))
        self._measured[key] = self._steps

    def release(self, seq) -> None:
        self.proposer.release(seq)

    def stats(self) -> dict:
        return spec_stats(self)


def spec_stats(decoder: "SpeculativeDecoder | None") -> dict:
    """vLLM's spec-decode counters plus the derived mean acceptance length (1 + accepted / drafts) and
    acceptance rate (accepted / drafted); all zero when speculation is off (``decoder`` None)."""
    drafts, drafted, accepted = ((decoder.num_drafts, decoder.num_draft_tokens, decoder.num_accepted_tokens)
                                 if decoder is not None else (0, 0, 0))
    return {"spec_decode_num_drafts": drafts, "spec_decode_num_draft_tokens": drafted,
            "spec_decode_num_accepted_tokens": accepted,
            "spec_decode_mean_acceptance_length": mean_acceptance_length(drafts, accepted),
            "spec_decode_acceptance_rate": accepted / drafted if drafted else 0.0,
            "spec_decode_num_accepted_tokens_per_pos": list(decoder.accepted_per_position) if decoder else []}


def mean_acceptance_length(num_drafts: int, num_accepted: int) -> float:
    """Tokens emitted per verification: the accepted drafts plus the model's own token (vLLM's definition)."""
    return 1.0 + num_accepted / num_drafts if num_drafts else 0.0


def make_speculative_decoder(config, max_model_len: int, target_runner=None, **draft_kw) -> SpeculativeDecoder:
    """The decoder for a ``speculative_config`` dict (or `SpeculativeConfig`)."""
    cfg = SpeculativeConfig.from_dict(config)
    return SpeculativeDecoder(cfg, make_proposer(cfg, target_runner, max_model_len, **draft_kw), max_model_len)
