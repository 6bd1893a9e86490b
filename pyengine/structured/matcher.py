"""S15 the four verbs of a grammar-constrained decoder: compile, allowed-token mask, advance, is_complete.

    grammar = compile_grammar(("json", schema), vocab)    # cached by (kind, spec, vocabulary)
    m = GrammarMatcher(grammar)
    logits = m.mask_logits(logits)                        # -inf on every token the grammar forbids
    m.advance(token_id)                                   # False if the token was not allowed
    m.is_complete()                                       # the output so far is a whole sentence

EOS (any of the vocabulary's stop ids) is allowed exactly when the output so far is complete; when the
grammar allows nothing more, EOS is the only token left. Masks are cached per automaton state as packed
bits, so a state seen before costs an unpack, not a walk over the vocabulary.
"""
from __future__ import annotations

import json
from collections import OrderedDict

import numpy as np

from . import ir
from .automaton import compile_rules
from .budget import Budget, GrammarTooLarge, compile_budget
from .gbnf import parse_gbnf
from .ir import GrammarError
from .json_schema import compile_json_schema, dumps, json_object_rules
from .regex import regex_to_ir
from .vocab import TokenVocabulary

KINDS = ("json", "regex", "choice", "grammar", "json_object")
COMPILE_CACHE_SIZE = 64
MASK_CACHE_STATES = 8192        # packed masks kept per grammar (49152 tokens -> 6 KiB each)
RECENT_STATES = 32              # unpacked (48 KiB each): a JSON string's states repeat token after token
MAX_GROWN_STATES = 200_000      # a cached pushdown matcher past this many interned states (they grow as
                                # outputs are decoded: counted strings, distinct names) is compiled afresh
                                # for new requests; running sequences keep the old one


def grammar_rules(kind: str, spec) -> tuple[dict, str]:
    """(rules, root) of one structured-output request."""
    if kind == "json":
        return compile_json_schema(spec)
    if kind == "json_object":
        return json_object_rules()
    if kind == "regex":
        return {"root": regex_to_ir(spec)}, "root"
    if kind == "choice":
        if not isinstance(spec, (list, tuple)) or not spec or not all(isinstance(c, str) for c in spec):
            raise GrammarError("choice must be a non-empty list of strings")
        return {"root": ir.literals(spec)}, "root"          # a trie: O(total length)
    if kind == "grammar":
        return parse_gbnf(spec)
    raise GrammarError(f"unknown structured output kind {kind!r} (one of {', '.join(KINDS)})")


def spec_key(kind: str, spec) -> str:
    try:
        return kind + ":" + (spec if isinstance(spec, str) else json.dumps(spec, sort_keys=True))
    except (TypeError, ValueError, RecursionError) as e:
        raise GrammarError(f"{kind}: not JSON-serialisable ({type(e).__name__})") from None


_refusals: OrderedDict = OrderedDict()      # spec key -> (GrammarError class, message, keyword)
REFUSAL_CACHE_SIZE = 256


def _remember(cache: OrderedDict, key, value, size: int) -> None:
    cache[key] = value
    cache.move_to_end(key)
    while len(cache) > size:
        cache.popitem(last=False)


def cached_automaton(key: str):
    """The automaton compiled for ``key`` (re-raising its refusal), or None if neither is cached."""
    refused = _refusals.get(key)
    if refused is not None:
        _refusals.move_to_end(key)
        cls, message, keyword = refused
        raise cls(message, keyword)
    hit = _cache.get((key, None))         # automata are vocabulary-free: (key, None) in the compile cache
    if hit is not None:
        if _grown(hit):
            del _cache[(key, None)]
            return None
        _cache.move_to_end((key, None))
    return hit


def _grown(automaton) -> bool:
    """A pushdown matcher whose run-time state tables have grown past MAX_GROWN_STATES."""
    return automaton.kind == "pda" and automaton.num_states > MAX_GROWN_STATES


def install(key: str, automaton=None, refusal: GrammarError | None = None) -> None:
    """Cache an automaton (or a refusal) compiled elsewhere, e.g. by the server's compile worker."""
    if refusal is not None:
        _remember(_refusals, key, (type(refusal), str(refusal), getattr(refusal, "keyword", None)),
                  REFUSAL_CACHE_SIZE)
    else:
        _remember(_cache, (key, None), automaton, 2 * COMPILE_CACHE_SIZE)


def export(request) -> tuple[str, object] | None:
    """(key, automaton) of a request (kind, spec) compiled in this process, for another process to `install`:
    S18's router compiles off its loop (the server's worker), and its instances take the automaton with the
    request instead of compiling it again on their step loop. None if it is not in the cache."""
    key = spec_key(*request)
    automaton = cached_automaton(key)
    return None if automaton is None else (key, automaton)


def compile_automaton(kind: str, spec, budget: Budget | None = None):
    """(kind, spec) -> automaton under a time/state budget, through the LRU caches of automata and of
    refusals (the same bad grammar is refused from the cache). Every failure is a `GrammarError`: deep
    nesting the parsers did not catch, memory, or a bug in a compiler must not become a 500."""
    key = spec_key(kind, spec)
    hit = cached_automaton(key)
    if hit is not None:
        return hit
    try:
        with compile_budget(budget or Budget()):
            automaton = compile_rules(*grammar_rules(kind, spec))
    except GrammarError as e:
        install(key, refusal=e)
        raise
    except RecursionError:
        e = GrammarError(f"{kind}: the grammar nests too deeply")
        install(key, refusal=e)
        raise e from None
    except MemoryError:
        raise GrammarTooLarge(f"{kind}: grammar too large (out of memory while compiling)") from None
    except (TypeError, KeyError, IndexError, AttributeError, OverflowError, ValueError) as e:
        err = GrammarError(f"{kind}: cannot compile this grammar ({type(e).__name__}: {str(e)[:200]})")
        install(key, refusal=err)
        raise err from None
    install(key, automaton)
    return automaton


class CompiledGrammar:
    """An automaton bound to a vocabulary, with the per-state mask cache."""

    def __init__(self, automaton, vocab: TokenVocabulary):
        self.automaton = automaton
        self.vocab = vocab
        self._masks: OrderedDict[int, np.ndarray] = OrderedDict()
        self._recent: OrderedDict[int, np.ndarray] = OrderedDict()   # unpacked masks of recent states
        self._eos = np.asarray(vocab.eos_token_ids, dtype=np.int64)

    @property
    def kind(self) -> str:
        return self.automaton.kind

    def token_mask(self, state: int) -> np.ndarray:
        """Bool (vocab.size,): tokens whose bytes the grammar accepts from ``state`` (EOS excluded)."""
        packed = self._masks.get(state)
        if packed is None:
            mask = self.automaton.token_mask(state, self.vocab)
            self._masks[state] = np.packbits(mask)
            if len(self._masks) > MASK_CACHE_STATES:
                self._masks.popitem(last=False)
            return mask
        self._masks.move_to_end(state)
        return np.unpackbits(packed, count=self.vocab.size).view(bool)

    def allowed(self, state: int) -> np.ndarray:
        """Bool (vocab.size,): the grammar's tokens plus EOS when the output can end here (read-only;
        the last RECENT_STATES states keep theirs unpacked)."""
        mask = self._recent.get(state)
        if mask is not None:
            self._recent.move_to_end(state)
            return mask
        mask = self.token_mask(state)
        if self.automaton.is_accepting(state) or not mask.any():
            mask = mask.copy()
            mask[self._eos[self._eos < len(mask)]] = True
        mask.flags.writeable = False
        self._recent[state] = mask
        if len(self._recent) > RECENT_STATES:
            self._recent.popitem(last=False)
        return mask


_cache: OrderedDict = OrderedDict()


def compile_grammar(request, vocab: TokenVocabulary) -> CompiledGrammar:
    """``request`` is (kind, spec). Compiled automata are cached by (kind, spec, vocabulary)."""
    kind, spec = request
    key = (spec_key(kind, spec), vocab.key)
    hit = _cache.get(key)
    if hit is not None:
        fresh = _grown(hit.automaton) and cached_automaton(key[0])     # None: compiled again below
        if not _grown(hit.automaton) or fresh is hit.automaton:
            _cache.move_to_end(key)
            return hit
    compiled = CompiledGrammar(compile_automaton(kind, spec), vocab)
    _remember(_cache, key, compiled, 2 * COMPILE_CACHE_SIZE)     # with the automata (key, None)
    return compiled


class GrammarMatcher:
    """The grammar state of one generated sequence (each of a request's n sequences has its own).

    A grammar's failure is its sequence's: an error while masking or advancing (the run-time stack budget
    of an ambiguous grammar, or any bug) is kept in ``error`` instead of raised into the engine's step.
    From then on only EOS is allowed and every token is taken, and the engine finishes the sequence with
    finish_reason "error" (`processor.grammar_outcome`); the other sequences of the batch go on."""

    def __init__(self, grammar: CompiledGrammar):
        self.grammar = grammar
        self.state = grammar.automaton.initial()
        self.history: list[int] = []          # states before each accepted token (for rollback)
        self.terminated = False               # EOS accepted
        self.error: str | None = None         # why the grammar failed for this sequence

    def _fail(self, exc: Exception) -> None:
        self.error = f"{type(exc).__name__}: {exc}"

    def _eos_only(self) -> np.ndarray:
        mask = np.zeros(self.grammar.vocab.size, dtype=bool)
        mask[self.grammar._eos] = True
        return mask

    def allowed_mask(self) -> np.ndarray:
        if self.terminated or self.error is not None:
            return self._eos_only()
        try:
            return self.grammar.allowed(self.state)
        except Exception as e:
            self._fail(e)
            return self._eos_only()

    def mask_logits(self, logits: np.ndarray) -> np.ndarray:
        """A copy of one logits row with -inf on the forbidden tokens."""
        from pyengine.layers.sampler import apply_allowed_mask
        return apply_allowed_mask(logits, self.allowed_mask())

    def advance(self, token_id: int) -> bool:
        """Consume a token; False (state unchanged) if the grammar does not allow it. After a failure
        (``error``) every token is taken: the sequence ends on it."""
        if self.error is None:
            try:
                return self._advance(token_id)
            except Exception as e:
                self._fail(e)
        self.history.append(self.state)      # taken without moving: a rollback (speculation) stays valid
        return True

    def _advance(self, token_id: int) -> bool:
        token_id = int(token_id)
        if token_id in self.grammar.vocab.eos_token_ids:
            if self.is_complete() or not self.grammar.token_mask(self.state).any():
                self.history.append(self.state)
                self.terminated = True
                return True
            return False
        if self.terminated:
            return False
        data = self.grammar.vocab.token_bytes[token_id] if token_id < len(self.grammar.vocab.token_bytes) else None
        return data is not None and self.advance_bytes(data)

    def accept_draft(self, token_ids) -> int:
        """Advance through a speculative draft as far as the grammar allows; returns how many tokens were
        accepted (the rest must be discarded; `rollback` undoes accepted ones the model then rejects)."""
        n = 0
        for t in token_ids:
            if not self.advance(t):
                break
            n += 1
        return n

    def draft_masks(self, token_ids) -> list[np.ndarray]:
        """S14 x S15, the masks along a speculative draft: ``masks[i]`` is the allowed mask after
        ``token_ids[:i]``, for the longest prefix the grammar allows (so ``len(masks) - 1`` draft tokens are
        allowed). The matcher is rolled back to where it was: the tokens the model keeps are advanced later."""
        masks = [self.allowed_mask()]
        for t in token_ids:
            if not self.advance(t):
                break
            masks.append(self.allowed_mask())
        self.rollback(len(masks) - 1)
        return masks

    def mask_after(self, token_ids) -> np.ndarray:
        """The allowed mask after ``token_ids`` (all allowed: a drafter masking its own guesses); the
        matcher is left where it was."""
        n = self.accept_draft(token_ids)
        try:
            if n < len(token_ids):
                raise ValueError(f"draft token {token_ids[n]} is outside the grammar")
            return self.allowed_mask()
        finally:
            self.rollback(n)

    def advance_bytes(self, data: bytes) -> bool:
        nxt = self.grammar.automaton.step(self.state, data)
        if not nxt:
            return False
        self.history.append(self.state)
        self.state = nxt
        return True

    def rollback(self, n: int = 1) -> None:
        """Undo the last n accepted tokens (speculative drafts that were rejected)."""
        if n > len(self.history):
            raise ValueError(f"cannot roll back {n} tokens, only {len(self.history)} accepted")
        for _ in range(n):
            self.state = self.history.pop()
        self.terminated = False

    def is_complete(self) -> bool:
        return self.terminated or self.grammar.automaton.is_accepting(self.state)

    def can_continue(self) -> bool:
        return not self.terminated and self.grammar.automaton.can_continue(self.state)


__all__ = ["CompiledGrammar", "GrammarMatcher", "GrammarError", "TokenVocabulary", "compile_grammar",
           "grammar_rules", "dumps", "KINDS"]
