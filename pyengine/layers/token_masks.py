"""Issue 32: the request's token masks — ``allowed_token_ids``, ``bad_words``, ``min_tokens`` and the thinking budget.

Logits processors with vLLM's semantics, applied where the sampling law puts masks (docs/sampling.md, step 4:
after logit bias and penalties, before temperature; a -inf entry stays -inf through bias and penalties, so the
order among masks and score shaping does not change any token):

- ``allowed_token_ids``: every other id is -inf (EOS too, unless listed: vLLM's rule).
- ``bad_words``: each word is banned as token sequences, the word as written (leading white space stripped) and,
  as vLLM does, its leading-space form when that encodes to as many tokens with another first token. A
  one-token sequence is always -inf; a longer one bans its last token whenever the output ends with the rest
  (the output only, as vLLM v1 reads it).
- ``min_tokens``: while fewer than that many tokens are out, EOS and ``stop_token_ids`` are -inf (and the stop
  checker ignores stop strings, engine/stop_checker.py).
- ``thinking_token_budget``: inside ``<think>...</think>`` (opened by the prompt, or at the start of the output)
  at most that many tokens are left to the model; then the tokens of ``"</think>\\n\\n"`` (as the model's tokenizer
  encodes it, Qwen3's template's closing) are forced one per step, and the answer follows.

The first two are hard masks. ``min_tokens`` and the forced end of thinking yield to them (and to a grammar):
when they would leave no token, they are not applied for that row; a row that the hard masks alone would leave
empty keeps the scores it came with. One `TokenMasks` per sequence (the thinking budget has state, advanced
with each appended token, as a grammar matcher is); a speculative verification row applies it after the drafts
before that row (``drafts``).
"""
from __future__ import annotations

import numpy as np

NEG_INF = -np.inf
THINK_START, THINK_END = b"<think>", b"</think>"
THINK_CLOSE = "</think>\n\n"          # what a spent budget forces (Qwen3's template closes thinking so)


def bad_words_token_ids(bad_words, encode) -> list[list[int]]:
    """vLLM's token sequences of ``bad_words``: the word (leading white space stripped), plus its leading-space
    form when that has as many tokens and another first token."""
    out: list[list[int]] = []
    for word in bad_words:
        plain = [int(t) for t in encode(word.lstrip())]
        if plain:
            out.append(plain)
        spaced = [int(t) for t in encode(" " + word.lstrip())]
        if spaced and (not plain or (spaced[0] != plain[0] and len(spaced) == len(plain))):
            out.append(spaced)
    return out


class ThinkingBudget:
    """The state of one sequence's thinking: "start" (only white space so far), "thinking" (``count`` tokens
    inside), "done" (closed, or never opened). Read on bytes, so a tag split over tokens is still seen."""

    def __init__(self, budget: int, close_ids: list[int], token_bytes, open_in_prompt: bool):
        self.budget, self.close_ids, self.token_bytes = int(budget), list(close_ids), token_bytes
        self.mode = "thinking" if open_in_prompt else "start"
        self.buf = b""               # start: the output so far; thinking: the tail that may hold a partial tag
        self.count = 0               # tokens inside the thinking block
        self.forced = 0              # tokens of close_ids already forced

    def copy(self) -> "ThinkingBudget":
        c = ThinkingBudget.__new__(ThinkingBudget)
        c.__dict__.update(self.__dict__)
        return c

    def forced_token(self) -> int | None:
        """The token the next step must emit (the budget is spent), else None."""
        if self.mode == "thinking" and self.count >= self.budget and self.forced < len(self.close_ids):
            return self.close_ids[self.forced]
        return None

    def advance(self, tok: int) -> None:
        if self.mode == "done":
            return
        if self.forced_token() is not None:          # closing by force
            if int(tok) == self.close_ids[self.forced]:
                self.forced += 1
                if self.forced == len(self.close_ids):
                    self.mode = "done"
            else:                                    # a hard mask or grammar overrode the force: let it be
                self.mode = "done"
            return
        b = self.token_bytes(int(tok))
        if self.mode == "start":
            self.buf += b
            s = self.buf.lstrip()
            if s.startswith(THINK_START):
                self.mode, self.buf = "thinking", s[len(THINK_START):]
                if THINK_END in self.buf:
                    self.mode = "done"
            elif not THINK_START.startswith(s):
                self.mode = "done"
            return
        self.buf = (self.buf + b)[-(len(THINK_END) - 1 + len(b)):]
        if THINK_END in self.buf:
            self.mode = "done"
        else:
            self.count += 1


def opens_thinking(prompt_ids, token_bytes) -> bool:
    """Whether the prompt leaves the model inside an open ``<think>`` (DeepSeek-R1's templates end so)."""
    text = b"".join(token_bytes(int(t)) for t in prompt_ids)
    i = text.rfind(THINK_START)
    return i >= 0 and text.find(THINK_END, i) < 0


class TokenMasks:
    """One sequence's masks (see the module docstring). ``apply(x, output_ids, drafts)`` -> masked float64 copy."""

    def __init__(self, vocab_size: int, allowed_token_ids=None, bad_words_ids=(), min_tokens: int = 0,
                 stop_ids=(), thinking: ThinkingBudget | None = None):
        self.vocab_size = int(vocab_size)
        ban = None
        if allowed_token_ids:
            ban = np.ones(self.vocab_size, dtype=bool)
            ban[np.asarray(allowed_token_ids, dtype=np.int64)] = False
        singles = [s[0] for s in bad_words_ids if len(s) == 1]
        if singles:
            ban = np.zeros(self.vocab_size, dtype=bool) if ban is None else ban
            ban[np.asarray(singles, dtype=np.int64)] = True
        self.ban = ban                                                    # static: a bool mask, or None
        self.sequences = [(tuple(s[:-1]), int(s[-1])) for s in bad_words_ids if len(s) > 1]
        self.min_tokens = int(min_tokens)
        self.stop_ids = np.asarray(sorted({int(t) for t in stop_ids}), dtype=np.int64)
        self.thinking = thinking

    def advance(self, tok: int) -> None:
        """``tok`` was appended to the sequence."""
        if self.thinking is not None:
            self.thinking.advance(tok)

    def apply(self, logits: np.ndarray, output_ids, drafts=()) -> np.ndarray:
        """Masked copy of one row; ``output_ids`` the sequence's output, ``drafts`` the drafts before this row
        (speculative verification: the thinking state is advanced over them, the rest reads them as output)."""
        x = np.array(logits, dtype=np.float64)
        V = x.shape[-1]
        out = list(output_ids) + [int(t) for t in drafts]
        if self.ban is not None:
            w = min(V, len(self.ban))
            x[:w][self.ban[:w]] = NEG_INF
        for prefix, last in self.sequences:
            if last < V and len(out) >= len(prefix) and tuple(out[len(out) - len(prefix):]) == prefix:
                x[last] = NEG_INF
        if not np.isfinite(x).any():                # a grammar left only banned tokens: keep its choice
            return np.array(logits, dtype=np.float64)
        if self.min_tokens and len(out) < self.min_tokens and len(self.stop_ids):
            ids = self.stop_ids[self.stop_ids < V]
            kept = x[ids]
            x[ids] = NEG_INF
            if not np.isfinite(x).any():            # only stop tokens are left: min_tokens yields
                x[ids] = kept
        if self.thinking is not None:
            state = self.thinking
            if drafts:
                state = state.copy()
                for t in drafts:
                    state.advance(t)
            forced = state.forced_token()
            if forced is not None and forced < V and np.isfinite(x[forced]):
                keep = x[forced]
                x = np.full_like(x, NEG_INF)
                x[forced] = keep
        return x


def build_token_masks(params, tokenizer, eos_token_ids, vocab_size: int, prompt_ids, n: int):
    """The n sequences' `TokenMasks` of a request (None when it sets none of the four fields). ValueError when
    the fields cannot hold on this model (no thinking template for a budget, a vocabulary they leave empty)."""
    if not params.has_token_masks:
        return None
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)       # noqa: E731
    bad = bad_words_token_ids(params.bad_words or (), encode)
    for seq in bad:
        if any(not 0 <= t < vocab_size for t in seq):
            raise ValueError(f"bad_words encode to token ids outside the vocabulary ({vocab_size})")
    stop_ids = set() if params.ignore_eos else set(eos_token_ids)
    stop_ids |= set(params.stop_token_ids or ())
    if params.allowed_token_ids:
        live = set(params.allowed_token_ids) - {s[0] for s in bad if len(s) == 1}
        if not live:
            raise ValueError("bad_words ban every token of allowed_token_ids")
    thinking_args = None
    if params.thinking_token_budget is not None:
        template = getattr(tokenizer, "chat_template", None) or ""
        if "<think>" not in template or "</think>" not in template:
            raise ValueError("thinking_token_budget needs a thinking model (a chat template that writes "
                             "<think>...</think>); this model's has none")
        close = [int(t) for t in encode(THINK_CLOSE)]
        if params.allowed_token_ids and not set(close) <= set(params.allowed_token_ids):
            raise ValueError("thinking_token_budget with allowed_token_ids: the ids of '</think>' "
                             f"({close}) must be allowed")
        thinking_args = (params.thinking_token_budget, close, tokenizer.token_bytes,
                         opens_thinking(prompt_ids, tokenizer.token_bytes))
    return [TokenMasks(vocab_size, params.allowed_token_ids, bad, params.min_tokens, stop_ids,
                       ThinkingBudget(*thinking_args) if thinking_args else None) for _ in range(n)]
