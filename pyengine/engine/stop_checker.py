"""S01: when does a sequence end, and which text may the user see so far?

One `StopChecker` per generated sequence. Each new token goes through `append`, which

1. ends the sequence on a stop token (``stop_token_ids``, or an EOS id unless ``ignore_eos``);
2. turns the token into text with the tokenizer's `IncrementalDetokenizer` (never half a UTF-8
   character);
3. looks for stop strings in the text not yet released. A stop string can be split across tokens,
   so any tail of the text that is the beginning of a stop string is *held back* until the next
   tokens decide it. The released text therefore never contains a stop string (unless
   ``include_stop_str_in_output``) and a finished text ends right before it;
4. ends the sequence with "length" after ``max_tokens`` tokens.

``min_tokens`` (vLLM's rule): until more than that many tokens are out, stop tokens and stop strings do not
end the sequence (the sampler keeps EOS and stop ids out too, layers/token_masks.py); a stop string completed
inside the first ``min_tokens`` tokens stays in the text.

A stop (token or string) on the last allowed token reports "stop", not "length": the model did stop.
"""
from __future__ import annotations

from dataclasses import dataclass

from pyengine.sampling_params import SamplingParams


@dataclass
class StopResult:
    delta_text: str                         # text released by this token (may be "")
    finish_reason: str | None = None        # None | "stop" | "length" (| "abort" via finish())
    stop_reason: str | int | None = None    # the stop string, or the stop / EOS token id

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def find_stop(text: str, stops: list[str]) -> tuple[int, str] | None:
    """The stop-string occurrence in `text` that *ends* first (then: starts first), as (start, stop).

    Ending first is what a token-by-token reader would meet first, so the result does not depend on
    how the text was cut into tokens.
    """
    best = None
    for s in stops:
        i = text.find(s)
        if i >= 0:
            key = (i + len(s), i)
            if best is None or key < best[0]:
                best = (key, s)
    return (best[0][1], best[1]) if best else None


def holdback_len(text: str, stops: list[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of some stop string."""
    longest = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:k]):
                longest = k
                break
    return longest


class StopChecker:
    """Incremental detokenization plus stop conditions for one sequence (see module docstring).

    `max_tokens` (keyword, optional) overrides ``params.max_tokens``: the engine passes the room left
    in the context when the request asked for ``max_tokens=None``.
    """

    def __init__(self, tokenizer, params: SamplingParams, eos_token_ids=(), *, max_tokens: int | None = None):
        from pyengine.tokenizer import IncrementalDetokenizer   # lazy: keeps `import pyengine` light

        self.params = params
        self.stops = list(params.stop or [])
        self.stop_token_ids = set(params.stop_token_ids or [])
        self.eos_token_ids = set() if params.ignore_eos else {int(t) for t in eos_token_ids}
        self.max_tokens = max_tokens if max_tokens is not None else params.max_tokens
        # skip_special_tokens is the detokenizer's job: it drops control tokens' text (<|im_end|>).
        self._detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=params.skip_special_tokens)
        self.text = ""                      # released text
        self._held = ""                     # decoded, not yet released (may start a stop string)
        self.num_tokens = 0
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def append(self, token_id: int) -> StopResult:
        """Account for one generated token; returns the newly released text and the finish state."""
        if self.finished:
            raise ValueError(f"sequence already finished ({self.finish_reason}); cannot append token {token_id}")
        token_id = int(token_id)
        self.num_tokens += 1
        if self.num_tokens > self.params.min_tokens and (
                token_id in self.stop_token_ids or token_id in self.eos_token_ids):
            # The stop token's own text is shown only with include_stop_str_in_output (as vLLM).
            if self.params.include_stop_str_in_output:
                self._held += self._detok.add(token_id)
            return self.finish("stop", token_id)
        self._held += self._detok.add(token_id)
        if self._cut_at_stop_string():
            return self._release_all()
        if self.max_tokens is not None and self.num_tokens >= self.max_tokens:
            return self.finish("length")
        keep = holdback_len(self._held, self.stops)
        delta = self._held[:len(self._held) - keep]
        self._held = self._held[len(self._held) - keep:]
        self.text += delta
        return StopResult(delta)

    def finish(self, reason: str, stop_reason: str | int | None = None) -> StopResult:
        """End the sequence now (stop token, length, or an external "abort"/context limit): flush the
        detokenizer and release the held text, still honouring stop strings."""
        if self.finished:
            raise ValueError(f"sequence already finished ({self.finish_reason})")
        self.finish_reason, self.stop_reason = reason, stop_reason
        self._held += self._detok.flush()
        self._cut_at_stop_string()
        return self._release_all()

    def _cut_at_stop_string(self) -> bool:
        """If the held text contains a stop string: truncate there and mark the sequence stopped."""
        hit = find_stop(self._held, self.stops) if self.num_tokens > self.params.min_tokens else None
        if hit is None:
            return False
        start, stop = hit
        self._held = self._held[:start + len(stop) if self.params.include_stop_str_in_output else start]
        self.finish_reason, self.stop_reason = "stop", stop
        return True

    def _release_all(self) -> StopResult:
        delta, self._held = self._held, ""
        self.text += delta
        return StopResult(delta, self.finish_reason, self.stop_reason)

