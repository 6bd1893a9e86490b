"""S15 the engine's side of structured output: one vocabulary, compiled grammars, a matcher per sequence.

`LLMEngine.add_request` asks `StructuredOutputs.matchers(params, n)` for the request's n matchers (None for
an unconstrained request; a bad grammar raises `GrammarError`, a ValueError, before anything is queued).
Each step the engine passes the sampled rows' `allowed_mask()` to the sampler (None for unconstrained
rows, which pay nothing) and advances each matcher with the token it sampled.

With speculative decoding (S14) a constrained sequence's draft is checked against its grammar before the
step is scheduled (`check_draft`: walk a matcher along the draft, cut it at the first forbidden token,
roll back), and each of its k+1 verification rows is masked with the grammar state after the drafts
before it (`mask_rows`), so greedy and rejection-sampled acceptance both see the distributions plain
constrained decoding samples from. The matcher then advances over exactly the tokens the step emits.
"""
from __future__ import annotations

import numpy as np

from .matcher import GrammarMatcher, compile_grammar
from .vocab import TokenVocabulary


class StructuredOutputs:
    def __init__(self, tokenizer, eos_token_ids, vocab_size: int):
        self.tokenizer = tokenizer
        self.eos_token_ids = sorted(eos_token_ids)
        self.vocab_size = vocab_size
        self._vocab: TokenVocabulary | None = None

    @property
    def vocab(self) -> TokenVocabulary:
        if self._vocab is None:          # built on the first constrained request (~0.2 s for 49k tokens)
            self._vocab = TokenVocabulary.from_tokenizer(self.tokenizer, self.eos_token_ids, self.vocab_size)
        return self._vocab

    def matchers(self, params, n: int) -> list[GrammarMatcher] | None:
        so = getattr(params, "structured_outputs", None)
        if so is None:
            return None
        grammar = compile_grammar(so.request, self.vocab)
        return [GrammarMatcher(grammar) for _ in range(n)]


# --- S14 x S15: speculative drafts checked against the grammar ----------------------------------------
def check_draft(matcher: GrammarMatcher, draft_ids: list[int], draft_probs):
    """Cut a constrained sequence's draft at the first token its grammar does not allow.

    Returns (the allowed prefix, its draft distributions or None, masks): ``masks[i]`` is the grammar's
    mask after ``prefix[:i]``, i.e. the mask of verification row i (k + 1 of them for k kept drafts).

    A drafter's distributions q are replaced by q masked and renormalised. That keeps rejection sampling
    exact: a draft drawn from q that survives the cut is a draw from q restricted to the allowed tokens,
    and a cut draft leaves its row to draw from p as a bonus row does. (Rejection against the unmasked q
    instead would draw too rarely the tokens q favours: the test's negative control shows it.) A
    drafter that masks its own guesses (`DraftModelProposer`) already gives masked q: then this is a no-op.
    """
    masks = matcher.draft_masks(draft_ids)
    k = len(masks) - 1
    prefix = list(draft_ids[:k])
    if draft_probs is None or k == 0:
        return prefix, None, masks
    q = np.array(draft_probs[:k], dtype=np.float64)
    for i in range(k):
        q[i] *= _fit(masks[i], q.shape[-1])
    return prefix, q / q.sum(axis=-1, keepdims=True), masks


def grammar_outcome(matcher, checker, res):
    """S15: the stop result of a token, turned into finish_reason "error" when the sequence's grammar
    failed (`GrammarMatcher.error`): that sequence ends here, nothing else is touched."""
    if matcher is None or matcher.error is None:
        return res
    if res.finished:
        checker.finish_reason = res.finish_reason = "error"
        return res
    return checker.finish("error")


def mask_rows(rows: np.ndarray, masks) -> np.ndarray:
    """Verification rows (k+1, V) with -inf on what each row's grammar state forbids (row i: the mask
    after the first i drafts), float64 as the plain sampler's masked rows are."""
    from pyengine.layers.sampler import apply_allowed_mask
    return np.stack([apply_allowed_mask(rows[i], masks[i]) for i in range(len(rows))])


def _fit(mask: np.ndarray, width: int) -> np.ndarray:
    """A vocabulary mask padded with False (or cut) to ``width`` logits columns."""
    if len(mask) >= width:
        return mask[:width]
    return np.concatenate([mask, np.zeros(width - len(mask), dtype=bool)])
