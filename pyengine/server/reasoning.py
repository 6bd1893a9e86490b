"""Reasoning models' thinking, split from the answer (S19): `<think> ... </think>` -> `reasoning_content`.

Qwen3 and the DeepSeek-R1 distills think before they answer, between `<think>` and `</think>`. Like vLLM's and
llama-server's reasoning parsers, the server returns that part as `message.reasoning_content` (streamed as
`delta.reasoning_content`) and only the rest as `content`; tools and structured output read the answer alone.

The parser is chosen from the model's chat template (`parser_for`): a template that writes `<think>` belongs to
a thinking model. Where the generation prompt itself ends inside an open `<think>` (DeepSeek-R1's templates add
it), the output starts in the reasoning; otherwise it starts in the answer and a `<think>` at its very start
(after white space) opens the reasoning. An output cut before `</think>` is all reasoning.

`ThinkSplitter` does the same incrementally for streams: text that might be the start of a tag is held back
until the next delta decides it, so a tag split across tokens never leaks into either field.
"""
from __future__ import annotations

from dataclasses import dataclass

START, END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningParser:
    start: str = START
    end: str = END

    def opens_in_prompt(self, prompt_text: str) -> bool:
        """Whether the rendered prompt leaves the model inside an open thinking block."""
        i = prompt_text.rfind(self.start)
        return i >= 0 and prompt_text.find(self.end, i) < 0

    def count_reasoning_tokens(self, decode, ids: list[int], in_reasoning: bool) -> int:
        """Usage's reasoning tokens (chat's ``completion_tokens_details``, the Responses API's
        ``output_tokens_details``), counted as vLLM's
        `BaseThinkingReasoningParser.count_reasoning_tokens` does: the output tokens between the start and the
        end tag, the tags' own tokens not counted (to the output's end when the thinking never closed; from its
        start when the prompt opened it; 0 when the output does not think). The tags are text here (several
        tokens each with a vocabulary that lacks them, or sharing a token with the text beside them): a token
        counts when its text lies wholly between them."""
        if not ids:
            return 0
        text = decode(ids)
        lo = 0
        if not in_reasoning:
            stripped = text.lstrip()
            if not stripped.startswith(self.start):
                return 0
            lo = len(text) - len(stripped) + len(self.start)
        hi = text.find(self.end, lo)
        hi = len(text) if hi < 0 else hi
        # token i spans [L(i), L(i+1)) with L(k) = len(decode(ids[:k])): count the i with L(i) >= lo, L(i+1) <= hi
        first = _first_prefix(decode, ids, lambda n: n >= lo)
        last = _first_prefix(decode, ids, lambda n: n > hi) - 1
        return max(0, last - first)

    def split(self, text: str, in_reasoning: bool) -> tuple[str | None, str]:
        """A whole output -> (reasoning or None, answer)."""
        s = ThinkSplitter(self, in_reasoning)
        r1, c1 = s.push(text)
        r2, c2 = s.flush()
        reasoning = r1 + r2
        return (reasoning if s.saw_reasoning else None), c1 + c2


class ThinkSplitter:
    """Incremental `<think>` splitter: push(delta) -> (reasoning delta, answer delta)."""

    def __init__(self, parser: ReasoningParser, in_reasoning: bool):
        self.p = parser
        self.mode = "reasoning" if in_reasoning else "start"   # start: only white space seen so far
        self.held = ""
        self.saw_reasoning = in_reasoning

    def push(self, delta: str) -> tuple[str, str]:
        text = self.held + delta
        self.held = ""
        reasoning, answer = [], []
        while text:
            if self.mode == "start":
                stripped = text.lstrip()
                if stripped.startswith(self.p.start):
                    self.mode, self.saw_reasoning = "reasoning", True
                    text = stripped[len(self.p.start):]
                elif self.p.start.startswith(stripped):      # maybe the start of the tag: wait for more
                    self.held = text
                    break
                else:
                    self.mode = "answer"
            elif self.mode == "reasoning":
                i = text.find(self.p.end)
                if i >= 0:
                    reasoning.append(text[:i])
                    text = text[i + len(self.p.end):]
                    self.mode = "after"
                    continue
                keep = _partial_suffix(text, self.p.end)
                reasoning.append(text[:len(text) - keep])
                self.held = text[len(text) - keep:]
                break
            elif self.mode == "after":                     # the white space between </think> and the answer
                stripped = text.lstrip()
                if not stripped:
                    break
                self.mode = "answer"
                text = stripped
            else:
                answer.append(text)
                break
        return "".join(reasoning), "".join(answer)

    def flush(self) -> tuple[str, str]:
        """The end of the output: held text is what it was (an unfinished tag is text)."""
        held, self.held = self.held, ""
        if self.mode == "reasoning":
            return held, ""
        return "", held if self.mode != "after" else ""


def _first_prefix(decode, ids: list[int], pred) -> int:
    """The least k in 0..len(ids) whose prefix text's length satisfies `pred` (monotone), len(ids) + 1 if none."""
    lo, hi = 0, len(ids) + 1
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if pred(len(decode(ids[:mid]))) else (mid + 1, hi)
    return lo


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


def parser_for(chat_template: str | None) -> ReasoningParser | None:
    """The reasoning parser of a model, from its chat template (None: not a thinking model)."""
    if chat_template and START in chat_template and END in chat_template:
        return ReasoningParser()
    return None
