"""Cheap lower bounds on how many tokens a text needs, to refuse an over-long prompt early (S02).

Tokenizing is pure Python: a server must not spend seconds merging a prompt it will refuse anyway. No token
covers more bytes than the longest one, so B bytes need at least B / max_token_bytes tokens
(`Tokenizer.min_tokens`, before any work). Inside one pre-tokenized piece the bound is much tighter: a
piece of ASCII letters (a word, maybe with its leading space) can only be covered by tokens that are
letters themselves, and SmolLM2's longest such token is 25 bytes against 81 for its longest token. So
`encode(limit=)` checks each long piece before merging it and stops with `TooManyTokens`.
"""
from __future__ import annotations

# Pieces shorter than this are merged without the check (the check costs more than they do).
LONG_PIECE = 256


class TooManyTokens(ValueError):
    """The text needs more than `limit` tokens (at least `at_least`); raised by encode(limit=)."""

    def __init__(self, at_least: int, limit: int):
        super().__init__(f"the text needs at least {at_least} tokens, more than the limit of {limit}")
        self.at_least, self.limit = at_least, limit


def piece_class(raw: bytes) -> str:
    """'alpha' (ASCII letters), 'digit', 'space' (whitespace) or 'other', after one optional leading space.
    Every substring of a piece of a class other than 'other' is of the same class or a lone space."""
    body = raw[1:] if raw[:1] == b" " else raw
    if not body or body.isspace():
        return "space"
    if body.isalpha():
        return "alpha"
    if body.isdigit():
        return "digit"
    return "other"


class PieceBound:
    """Per class, the most bytes one token of that class covers (built from every token's bytes)."""

    def __init__(self, token_bytes):
        most: dict[str, int] = {}
        for raw in token_bytes:
            c = piece_class(raw)
            most[c] = max(most.get(c, 0), len(raw))
        overall = max(most.values(), default=1)
        # a lone leading space (1 byte) may be a token of its own inside an alpha or digit piece
        self.most = {c: max(most.get(c, 1), 1) for c in ("alpha", "digit", "space")}
        self.most["other"] = overall

    def min_tokens(self, raw: bytes) -> int:
        return -(-len(raw) // self.most[piece_class(raw)])

    def check(self, raw: bytes, have: int, limit: int) -> None:
        """Raise TooManyTokens if `have` ids plus this piece's bound exceed `limit`."""
        need = have + self.min_tokens(raw)
        if need > limit:
            raise TooManyTokens(need, limit)
