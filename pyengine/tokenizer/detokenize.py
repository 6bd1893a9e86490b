"""Turning ids back into text, all at once or one token at a time (S02, used by S01's stop checker).

Two decoders, matching HF's:
- byte-level: concatenate every token's bytes, then UTF-8 decode with U+FFFD for invalid bytes.
- SentencePiece: "▁" -> " "; runs of byte tokens "<0xNN>" are decoded together, and a run that is not
  valid UTF-8 becomes one U+FFFD *per byte token* (HF's ByteFallback rule); Llama-style vocabularies
  also drop the one leading space the encoder added.

Streaming must never show half a character: an emoji can arrive as four byte tokens. The incremental
decoders hold back exactly what the full decoder could still reinterpret, so the concatenated deltas
always equal `decode(all ids)`.
"""
from __future__ import annotations

import codecs


class ByteLevelDecoder:
    def __init__(self, token_bytes: list[bytes]):
        self.token_bytes = token_bytes

    def decode(self, ids: list[int]) -> str:
        tb = self.token_bytes
        return b"".join(tb[i] for i in ids).decode("utf-8", errors="replace")

    def stream(self) -> "_ByteLevelStream":
        return _ByteLevelStream(self.token_bytes)


class _ByteLevelStream:
    def __init__(self, token_bytes: list[bytes]):
        self.token_bytes = token_bytes
        # Python's incremental UTF-8 decoder buffers an incomplete tail and replaces invalid bytes the
        # same way a one-shot decode does.
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        return self._utf8.decode(self.token_bytes[token_id])

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)


class SentencePieceDecoder:
    """pieces[i]: the token's text with ▁ as space; byte_value[i]: the byte of a <0xNN> token, else None."""

    def __init__(self, pieces: list[str], byte_value: list[int | None], strip_leading_space: bool):
        self.pieces = pieces
        self.byte_value = byte_value
        self.strip_leading_space = strip_leading_space

    def decode(self, ids: list[int]) -> str:
        stream = self.stream()
        return "".join([stream.push(i) for i in ids]) + stream.flush()

    def stream(self) -> "_SentencePieceStream":
        return _SentencePieceStream(self)


def _byte_run_text(run: bytearray) -> str:
    try:
        return run.decode("utf-8")
    except UnicodeDecodeError:
        return "\ufffd" * len(run)


class _SentencePieceStream:
    def __init__(self, dec: SentencePieceDecoder):
        self.dec = dec
        self._run = bytearray()       # byte tokens whose fate (valid text or U+FFFDs) is still open
        self._started = False         # anything emitted yet (for the leading-space strip)

    def _emit(self, text: str) -> str:
        if not self._started and text:
            self._started = True
            if self.dec.strip_leading_space and text[0] == " ":
                text = text[1:]
        return text

    def push(self, token_id: int) -> str:
        value = self.dec.byte_value[token_id]
        if value is not None:
            self._run.append(value)
            return ""
        out = ""
        if self._run:
            out = _byte_run_text(self._run)
            self._run.clear()
        return self._emit(out + self.dec.pieces[token_id])

    def flush(self) -> str:
        out = _byte_run_text(self._run) if self._run else ""
        self._run.clear()
        return self._emit(out)


class IncrementalDetokenizer:
    """Feed ids one by one; each `add` returns only complete new text, `flush` the rest.

    ``"".join(deltas) + flush() == tok.decode(ids, skip_special_tokens)`` for any ids.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._stream = tokenizer.decoder.stream()
        self.ids: list[int] = []

    def add(self, token_id: int) -> str:
        token_id = self.tokenizer.check_id(token_id)
        self.ids.append(token_id)
        if self.skip_special_tokens and token_id in self.tokenizer.special_ids:
            return ""
        return self._stream.push(token_id)

    def flush(self) -> str:
        return self._stream.flush()
