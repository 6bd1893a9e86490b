"""S15 the engine's side of structured output: one vocabulary, compiled grammars, a matcher per sequence.

`LLMEngine.add_request` asks `StructuredOutputs.matchers(params, n)` for the request's n matchers (None for
an unconstrained request; a bad grammar raises `GrammarError`, a ValueError, before anything is queued).
Each step the engine passes the sampled rows' `allowed_mask()` to the sampler (None for unconstrained
rows, which pay nothing) and advances each matcher with the token it sampled. A matcher can roll back
accepted tokens, which is what checking speculative drafts against the grammar needs.
"""
from __future__ import annotations

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
