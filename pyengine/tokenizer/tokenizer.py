"""`Tokenizer`: text <-> token ids for a GGUF model, exactly as HF transformers' GGUF loader does (S02).

Pipeline of `encode`:
1. special tokens: control tokens (<|im_start|>, <start_of_turn>, ...) and user-defined tokens are found
   in the raw text first (leftmost, longest) and become single ids; the text between them goes on.
2. the model: byte-level BPE (`bpe.py`) or SentencePiece-style BPE with byte fallback (`spm.py`).
3. BOS/EOS only when `add_special_tokens=True` and the file asks for them (`tokenizer.ggml.add_bos_token`).

`encode_chat` renders a conversation and encodes it with the messages' text as plain text: a control-token
string inside a message stays characters, so a user cannot forge a turn. `min_tokens` and `encode(limit=)`
let a server reject an over-long prompt before (or early in) the pure-Python merge work.

Everything is built from the GGUF metadata dict, so it works from bytes (Pyodide) as well as paths.
"""
from __future__ import annotations

import functools
import re

from .bpe import BYTE_TO_CHAR, ByteLevelBPE, byte_level_spelling
from .detokenize import ByteLevelDecoder, SentencePieceDecoder
from .length_bound import TooManyTokens
from .pretokenize import WHITE_SPACE, get_pretokenizer, normalization_for
from .spm import SPACE, SentencePieceBPE, byte_token_value

CONTROL, USER_DEFINED = 3, 4      # llama.cpp token types
GEMMA_ARCHS = ("gemma", "gemma2", "gemma3")
# Chat end-of-turn tokens, stops besides eos (llama.cpp calls the set "end of generation").
END_OF_TURN_TOKENS = ("<|im_end|>", "<|endoftext|>", "<end_of_turn>", "<|eot_id|>", "<|eom_id|>",
                      "<|end|>", "<|end_of_text|>", "</s>", "<eos>")
# Unicode noncharacters are reserved for a program's internal use: encode_chat marks message text with one.
NONCHARACTERS = tuple(chr(c) for c in range(0xFDD0, 0xFDF0))


class SpecialTokenMatcher:
    """Leftmost-longest search for added tokens in raw text (what HF's Aho-Corasick pass does)."""

    def __init__(self, added: dict[str, int]):
        self.added = added
        by_first: dict[str, set[int]] = {}
        for text in added:
            by_first.setdefault(text[0], set()).add(len(text))
        self.lengths = {c: sorted(ls, reverse=True) for c, ls in by_first.items()}
        # Candidate starts are found by `re` (C speed), so text without them costs no Python loop.
        self._starts = re.compile("[" + "".join(re.escape(c) for c in sorted(by_first)) + "]") if by_first else None

    def find(self, text: str):
        """Yield (start, end, token_text) of non-overlapping matches, left to right."""
        if self._starts is None:
            return
        lengths, added, search = self.lengths, self.added, self._starts.search
        m = search(text)
        while m is not None:
            i = m.start()
            for length in lengths[text[i]]:
                if text[i:i + length] in added:
                    yield i, i + length, text[i:i + length]
                    i += length
                    break
            else:
                i += 1
            m = search(text, i)


class Tokenizer:
    def __init__(self, model, decoder, tokens: list[str], token_types: list[int], added: dict[str, int],
                 special_ids: set[int], bos_token_id, eos_token_id, unk_token_id=None, pad_token_id=None,
                 add_bos_token=False, add_eos_token=False, chat_template: str | None = None,
                 extra_stop_ids=(), kind: str = "bpe"):
        self.model = model
        self.decoder = decoder
        self.tokens = tokens
        self.token_types = token_types
        self.added = added                      # token text -> id, matched in raw text
        self.special_ids = special_ids          # ids dropped by skip_special_tokens (control tokens)
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.unk_token_id = unk_token_id
        self.pad_token_id = pad_token_id
        self.add_bos_token = add_bos_token
        self.add_eos_token = add_eos_token
        self.chat_template = chat_template
        self.kind = kind
        self.rstrip_ids: set[int] = set()       # added tokens that swallow the whitespace after them (Phi-3)
        self._matcher = SpecialTokenMatcher(added)
        stops = {eos_token_id} if eos_token_id is not None else set()
        stops.update(extra_stop_ids)
        stops.update(added[t] for t in END_OF_TURN_TOKENS if t in added and added[t] in special_ids)
        self.stop_token_ids = sorted(stops)

    # -- construction -----------------------------------------------------------------------------------
    @classmethod
    def from_gguf(cls, source, pre: str | None = None) -> "Tokenizer":
        """From a GGUF path, its bytes/memoryview, or an open `GGUFFile`."""
        from ..gguf.reader import GGUFFile
        gguf = source if isinstance(source, GGUFFile) else GGUFFile(source)
        return cls.from_metadata(gguf.metadata, pre=pre)

    @classmethod
    def from_metadata(cls, md: dict, pre: str | None = None) -> "Tokenizer":
        """From GGUF metadata (llama.cpp key names). `pre` overrides the split `tokenizer.ggml.pre` names
        (the file's own normalization, NFC for Qwen, stays)."""
        kind = md.get("tokenizer.ggml.model")
        tokens = md.get("tokenizer.ggml.tokens")
        if kind is None or tokens is None:
            raise ValueError("metadata has no tokenizer (tokenizer.ggml.model / tokenizer.ggml.tokens missing)")
        tokens = list(tokens)
        n = len(tokens)
        types = _int_list(md.get("tokenizer.ggml.token_type"), n, "tokenizer.ggml.token_type", default=1)

        def token_id(key):
            value = md.get(key)
            if value is None:
                return None
            value = int(value)
            if not 0 <= value < n:
                raise ValueError(f"{key} = {value} is outside the vocabulary (size {n})")
            return value

        bos, eos = token_id("tokenizer.ggml.bos_token_id"), token_id("tokenizer.ggml.eos_token_id")
        unk, pad = token_id("tokenizer.ggml.unknown_token_id"), token_id("tokenizer.ggml.padding_token_id")
        extra_stops = [i for i in (token_id("tokenizer.ggml.eot_token_id"), token_id("tokenizer.ggml.eom_token_id"))
                       if i is not None]
        arch = md.get("general.architecture")
        add_bos = md.get("tokenizer.ggml.add_bos_token")
        if add_bos is None:
            add_bos = kind == "llama"  # HF/llama.cpp default for SentencePiece vocabularies
        add_eos = bool(md.get("tokenizer.ggml.add_eos_token", False))
        template = md.get("tokenizer.chat_template")

        if kind == "gpt2":
            merges = md.get("tokenizer.ggml.merges")
            if merges is None:
                raise ValueError("byte-level BPE (tokenizer.ggml.model = 'gpt2') needs tokenizer.ggml.merges")
            # `pre` swaps the split only: the text is normalized as the file's own family does it
            own = md.get("tokenizer.ggml.pre")
            split = get_pretokenizer(pre or own, normalization_for(own) or "" if pre else None)
            model = ByteLevelBPE(tokens, list(merges), split)
            vocab = model.vocab
            alphabet = set(BYTE_TO_CHAR.values())
            # Control tokens spelled outside the byte alphabet are llama.cpp mislabels; HF skips them.
            special = {t: i for i, t in enumerate(tokens) if types[i] == CONTROL and set(t) <= alphabet}
            user = {t: i for i, t in enumerate(tokens) if types[i] == USER_DEFINED and t in vocab}
            decoder = ByteLevelDecoder([byte_level_spelling(t) for t in tokens])
        elif kind == "llama":
            gemma = arch in GEMMA_ARCHS
            scores = md.get("tokenizer.ggml.scores")
            if gemma:
                # Gemma files spell space-only tokens with real spaces; the model looks them up as ▁▁..
                tokens_m = [SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
                rank_scores = [-i for i in range(n)]  # file order is Gemma's merge order
            else:
                tokens_m = tokens
                if scores is None and md.get("tokenizer.ggml.merges") is None:
                    raise ValueError("SentencePiece vocabulary needs tokenizer.ggml.scores or tokenizer.ggml.merges")
                rank_scores = [0.0] * n if scores is None else _float_list(scores, n, "tokenizer.ggml.scores")
            merges = md.get("tokenizer.ggml.merges")
            # llama.cpp puts a space before every text segment unless the file says add_space_prefix = false,
            # as the families' own (legacy) tokenizer.json do. A non-Gemma file that says false gets what
            # transformers' GGUF loader builds for it: one "▁" at the very start (tokenizer_spm_llama.json).
            every = not gemma and bool(md.get("tokenizer.ggml.add_space_prefix", True))
            model = SentencePieceBPE(tokens_m, rank_scores, list(merges) if merges is not None else None,
                                     prefix_space=not gemma, unk_id=unk, prefix_every_segment=every)
            vocab = model.vocab
            special = {t: i for i, t in enumerate(tokens) if types[i] == CONTROL}
            user = {t: i for i, t in enumerate(tokens) if types[i] == USER_DEFINED and t in vocab}
            pieces = [t.replace(SPACE, " ") for t in tokens_m]
            decoder = SentencePieceDecoder(pieces, [byte_token_value(p) for p in pieces],
                                           strip_leading_space=not gemma)
        else:
            raise ValueError(f"tokenizer.ggml.model = {kind!r} is not supported (supported: 'gpt2', 'llama')")

        # HF gives an added token the vocabulary's id for its text (the last one, if spelled twice).
        added = {t: vocab.get(t, i) for t, i in {**special, **user}.items()}
        special_ids = {added[t] for t in special}
        tok = cls(model, decoder, tokens, types, added, special_ids, bos, eos, unk, pad,
                  bool(add_bos), add_eos, template, extra_stops, kind="bpe" if kind == "gpt2" else "spm")
        if arch == "phi3" and kind == "llama":
            # Phi-3/3.5's tokenizer.json gives its chat tokens rstrip=True: the whitespace after <|user|>,
            # <|end|>, ... belongs to the token ("<|user|>\nHi" -> <|user|> ▁Hi). llama.cpp sets the same
            # attribute for files named phi-3 (all control tokens but <unk>, <s>, <|endoftext|>; and </s>).
            keep = {"<unk>", "<s>", "<|endoftext|>"}
            tok.rstrip_ids = {i for t, i in added.items() if (i in special_ids and t not in keep) or t == "</s>"}
        return tok

    # -- basic facts -------------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.added.get(token, self.model.vocab.get(token))

    def id_to_token(self, token_id: int) -> str:
        return self.tokens[self.check_id(token_id)]

    def check_id(self, token_id) -> int:
        try:
            i = int(token_id)
        except (TypeError, ValueError):
            raise ValueError(f"token id {token_id!r} is not an integer") from None
        if i != token_id or not 0 <= i < len(self.tokens):
            raise ValueError(f"token id {token_id!r} is outside the vocabulary (size {len(self.tokens)})")
        return i

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes a token stands for (a byte token is one byte, maybe half a character)."""
        i = self.check_id(token_id)
        if self.kind == "bpe":
            return self.decoder.token_bytes[i]
        value = self.decoder.byte_value[i]
        return bytes([value]) if value is not None else self.decoder.pieces[i].encode("utf-8")

    # -- encode / decode ---------------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = False, parse_special: bool = True,
               limit: int | None = None) -> list[int]:
        """Text -> ids. `parse_special=False` reads control tokens in the text as plain characters (HF's
        split_special_tokens=True); user-defined tokens are still matched, as in HF and llama.cpp.
        `limit`: raise `TooManyTokens` (a ValueError) as soon as more than `limit` ids are certain, long
        before the whole text is merged (length_bound.py)."""
        if not isinstance(text, str):
            raise ValueError(f"text must be a str, got {type(text).__name__}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"text is not valid Unicode (lone surrogate at index {e.start})") from None
        ids = self._encode_text(text, parse_special, limit)
        if add_special_tokens:
            if self.add_bos_token and self.bos_token_id is not None:
                ids.insert(0, self.bos_token_id)
            if self.add_eos_token and self.eos_token_id is not None:
                ids.append(self.eos_token_id)
        return ids

    def _encode_text(self, text: str, parse_special: bool, limit: int | None, mark: str | None = None) -> list[int]:
        """Special tokens first, the model between them. `mark` (see encode_chat) is deleted from each
        segment before the model sees it, after the special-token search, so marked text never matches."""
        ids: list[int] = []
        pos = 0
        for start, end, token in self._matcher.find(text):
            tid = self.added[token]
            if not parse_special and tid in self.special_ids:
                continue  # stays part of the surrounding text
            if start < pos:
                continue                  # inside whitespace an rstrip token swallowed
            if start > pos:
                ids.extend(self._encode_segment(text[pos:start], pos == 0, limit, mark, len(ids)))
            ids.append(tid)
            pos = end
            if tid in self.rstrip_ids:
                pos = _skip_white_space(text, pos, mark)
            if limit is not None and len(ids) > limit:
                raise TooManyTokens(len(ids), limit)
        if pos < len(text):
            ids.extend(self._encode_segment(text[pos:], pos == 0, limit, mark, len(ids)))
        return ids

    def _encode_segment(self, text: str, at_start: bool, limit: int | None = None, mark: str | None = None,
                        have: int = 0) -> list[int]:
        if mark is not None:
            text = text.replace(mark, "")
            if not text:
                return []
        room = None if limit is None else limit - have
        try:
            if self.kind == "spm":
                return self.model.encode_segment(text, at_start, room)
            return self.model.encode_segment(text, room)
        except TooManyTokens as exc:     # counted within the segment: add what came before it
            raise TooManyTokens(exc.at_least + have, limit) from None

    # -- cheap length bounds -------------------------------------------------------------------------------
    @functools.cached_property
    def max_token_bytes(self) -> int:
        """The most input bytes one token can stand for (its spelling or, for added tokens, its text)."""
        spelled = max(len(self.token_bytes(i)) for i in range(len(self.tokens)))
        return max(spelled, *(len(t.encode("utf-8")) for t in self.added)) if self.added else spelled

    def min_tokens(self, text: str) -> int:
        """A lower bound on len(encode(text)) computed without tokenizing (C-speed byte operations): no
        token covers more than `max_token_bytes` bytes. 0 when the vocabulary allows no bound (SentencePiece
        without complete byte fallback fuses any run of unknown characters into one <unk>)."""
        if self.kind == "bpe":       # count what is tokenized: NFC may compose characters into fewer bytes
            text = self.model.pretokenizer.normalize(text)
        raw = text.encode("utf-8", errors="surrogatepass")
        if self.kind == "bpe":
            if self.model.missing_bytes:          # bytes without a token are dropped, not counted
                raw = raw.translate(None, self.model.missing_bytes)
        elif None in self.model._byte_ids and self.unk_token_id is not None:
            return 0
        return -(-len(raw) // self.max_token_bytes)

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        ids = [self.check_id(i) for i in ids]
        if skip_special_tokens:
            ids = [i for i in ids if i not in self.special_ids]
        return self.decoder.decode(ids)

    # -- chat ----------------------------------------------------------------------------------------------
    @property
    def special_tokens_map(self) -> dict[str, str]:
        """bos/eos/unk/pad token texts, the variables HF passes to chat templates."""
        out = {}
        for name, tid in (("bos_token", self.bos_token_id), ("eos_token", self.eos_token_id),
                          ("unk_token", self.unk_token_id), ("pad_token", self.pad_token_id)):
            if tid is not None:
                out[name] = self.tokens[tid]
        return out

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, tokenize: bool = False,
                            chat_template: str | None = None, **kwargs):
        """Render a conversation the way HF's `apply_chat_template` does; ids if `tokenize`."""
        from .chat_template import render_chat
        for unsupported in ("documents", "continue_final_message"):   # tools: where the template takes them
            if kwargs.get(unsupported):
                raise ValueError(f"apply_chat_template: {unsupported}= is not supported")
        template = chat_template if chat_template is not None else self.chat_template
        if template is None:
            raise ValueError("this model has no chat template (tokenizer.chat_template); pass chat_template=")
        text = render_chat(template, messages, add_generation_prompt=add_generation_prompt,
                           **{**self.special_tokens_map, **kwargs})
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def encode_chat(self, messages, add_generation_prompt: bool = True, special_tokens_in_content: bool = False,
                    limit: int | None = None, **kwargs) -> tuple[str, list[int]]:
        """(rendered text, ids) of a conversation (`limit` as in `encode`). The messages' text is plain
        text: "<|im_end|>" typed in a message is encoded as its characters, never as the control token, so no message can open a
        forged turn; the template's own markers stay control tokens. `special_tokens_in_content=True`
        restores rendering then encoding the whole text (HF's apply_chat_template(tokenize=True)).

        How: every control-token string found in a message gets a noncharacter MARK between its
        characters (and MARK closes off the message's non-blank ends), the template renders the marked
        text, the special-token search runs over it (marked strings cannot match), and MARK is deleted from
        the text between special tokens before the model encodes it."""
        if special_tokens_in_content:
            text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **kwargs)
            return text, self._encode_text(text, True, limit)
        # every string a template may print: message fields (tool calls, reasoning) and tool definitions too
        strings = list(_strings([messages, kwargs.get("tools")]))
        template = kwargs.get("chat_template") or self.chat_template or ""
        mark = next((c for c in NONCHARACTERS if c not in template and not any(c in t for t in strings)), None)
        if mark is None:
            raise ValueError("the messages use every Unicode noncharacter U+FDD0..U+FDEF")
        marked = [{k: (self._mark_specials(v, mark) if k == "content" and isinstance(v, str)
                       else v if k == "role" else self._mark_nested(v, mark)) for k, v in m.items()}
                  if isinstance(m, dict) else m for m in messages]
        if kwargs.get("tools") is not None:
            kwargs = {**kwargs, "tools": self._mark_nested(kwargs["tools"], mark)}
        text = self.apply_chat_template(marked, add_generation_prompt=add_generation_prompt, **kwargs)
        return text.replace(mark, ""), self._encode_text(text, True, limit, mark)

    def _mark_nested(self, value, mark: str):
        """Control-token strings inside nested message fields and tool definitions, marked like content's
        (inside only: their ends are not closed off, so a template's tests on them see the same text)."""
        if isinstance(value, str):
            return self._mark_specials(value, mark, ends=False)
        if isinstance(value, dict):
            return {self._mark_nested(k, mark): self._mark_nested(v, mark) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self._mark_nested(v, mark) for v in value]
        return value

    def _mark_specials(self, content: str, mark: str, ends: bool = True) -> str:
        if not content:
            return content
        out, pos = [], 0
        for start, end, token in self._matcher.find(content):
            if self.added[token] in self.special_ids:
                out += [content[pos:start], mark.join(token)]
                pos = end
        out.append(content[pos:])
        text = "".join(out)
        if not ends:
            return text
        # An end is closed off only where a control token could straddle it (the content starts with the
        # rest of one, or ends with the start of one): elsewhere a mark would only change what the template's
        # string tests see (Qwen3's startswith('<tool_response>')). Blank ends stay bare: templates trim them.
        heads, tails = self._straddles
        reach = range(1, min(len(content), self._straddle_len) + 1)
        head = mark if not content[0].isspace() and any(content[:k] in heads for k in reach) else ""
        tail = mark if not content[-1].isspace() and any(content[-k:] in tails for k in reach) else ""
        return head + text + tail

    @functools.cached_property
    def _straddles(self) -> tuple[frozenset, frozenset]:
        """(proper suffixes, proper prefixes) of the control tokens' texts."""
        specials = [t for t, i in self.added.items() if i in self.special_ids]
        return (frozenset(t[k:] for t in specials for k in range(1, len(t))),
                frozenset(t[:k] for t in specials for k in range(1, len(t))))

    @functools.cached_property
    def _straddle_len(self) -> int:
        return max((len(t) for t in self.added), default=0)

    def __repr__(self) -> str:
        return f"Tokenizer({self.kind}, vocab_size={self.vocab_size})"


def _strings(value):
    """Every str inside nested dicts (keys too), lists and tuples."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _strings(k)
            yield from _strings(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _strings(v)


_WHITE = frozenset(c for c in map(chr, range(0x3001)) if re.fullmatch(f"[{WHITE_SPACE}]", c))


def _skip_white_space(text: str, pos: int, mark: str | None) -> int:
    """Past the Unicode White_Space (HF's rstrip) at text[pos:]; encode_chat's mark counts as nothing."""
    while pos < len(text) and (text[pos] in _WHITE or (mark is not None and text[pos] == mark)):
        pos += 1
    return pos


def _int_list(values, n: int, key: str, default: int) -> list[int]:
    if values is None:
        return [default] * n
    out = [int(v) for v in (values.tolist() if hasattr(values, "tolist") else values)]
    if len(out) != n:
        raise ValueError(f"{key} has {len(out)} entries for {n} tokens")
    return out


def _float_list(values, n: int, key: str) -> list[float]:
    out = [float(v) for v in (values.tolist() if hasattr(values, "tolist") else values)]
    if len(out) != n:
        raise ValueError(f"{key} has {len(out)} entries for {n} tokens")
    return out
