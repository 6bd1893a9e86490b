"""StopChecker: table-driven cases on a small byte vocabulary, then properties with the real SmolLM2
tokenizer (stop strings cut anywhere inside and across tokens)."""
import random

import pytest

from pyengine.engine.stop_checker import StopChecker, find_stop, holdback_len
from pyengine.sampling_params import SamplingParams
from pyengine.tokenizer.detokenize import ByteLevelDecoder

# --- a byte-level toy tokenizer (the real IncrementalDetokenizer runs on top of it) --------------
PIECES = [b"<eos>", b"Hello", b" world", b"!", b"\n", b"\n\n", b"ST", b"OP", b"STOP", b"a", b"b", b"c",
          b"abcd", b"\xe2\x82", b"\xac", b"<|im_end|>", b"d"]
ID = {p.decode("utf-8", "replace"): i for i, p in enumerate(PIECES)}
ID["E2"], ID["AC"], EOS, IM_END = 13, 14, 0, 15


class ToyTokenizer:
    """Just what the detokenizer needs: the real byte-level decoder over PIECES."""
    vocab_size = len(PIECES)
    eos_token_id = EOS
    stop_token_ids = [EOS, IM_END]
    special_ids = {EOS, IM_END}
    decoder = ByteLevelDecoder(PIECES)

    def check_id(self, tid):
        if not 0 <= tid < len(PIECES):
            raise ValueError(f"token id {tid} is outside the vocabulary")
        return tid



def run(tokens, eos=(EOS,), **params):
    """Feed `tokens` (names or ids) until finished; returns (checker, deltas, results)."""
    checker = StopChecker(ToyTokenizer(), SamplingParams(**params), set(eos))
    deltas, results = [], []
    for t in tokens:
        res = checker.append(ID[t] if isinstance(t, str) else t)
        deltas.append(res.delta_text)
        results.append(res)
        assert "".join(deltas) == checker.text
        if not params.get("include_stop_str_in_output"):
            for s in checker.stops:
                assert s not in checker.text               # a stop string never leaks, not even midway
        if res.finished:
            break
    return checker, deltas, results


CASES = [
    # tokens, params, text, finish_reason, stop_reason
    (["Hello", " world", "!"], dict(max_tokens=3), "Hello world!", "length", None),
    (["Hello", EOS, "!"], dict(max_tokens=5), "Hello", "stop", EOS),
    (["Hello", EOS, "!"], dict(max_tokens=3, ignore_eos=True), "Hello!", "length", None),
    (["Hello", EOS, "!"], dict(max_tokens=3, ignore_eos=True, skip_special_tokens=False), "Hello<eos>!", "length",
     None),
    (["Hello", "!", "a"], dict(stop_token_ids=[ID["!"]]), "Hello", "stop", ID["!"]),
    (["Hello", "!", "a"], dict(stop_token_ids=[ID["!"]], include_stop_str_in_output=True), "Hello!", "stop", ID["!"]),
    (["a", "ST", "OP", "b"], dict(stop="STOP"), "a", "stop", "STOP"),
    (["a", "ST", "OP", "b"], dict(stop="STOP", include_stop_str_in_output=True), "aSTOP", "stop", "STOP"),
    (["a", "STOP", "b"], dict(stop="TO"), "aS", "stop", "TO"),                      # inside one token
    (["a", "ST", "a", "b"], dict(stop="STOP", max_tokens=4), "aSTab", "length", None),  # false alarm released
    (["Hello", " world"], dict(stop="wor"), "Hello ", "stop", "wor"),
    (["abcd"], dict(stop=["abcd", "bc"]), "a", "stop", "bc"),                       # the one that ends first
    (["a", "b", "c", "d"], dict(stop=["abcd", "bc"]), "a", "stop", "bc"),           # ... same token by token
    (["abcd"], dict(stop=["cd", "abc"]), "", "stop", "abc"),
    (["E2", "AC", "a"], dict(stop="€"), "", "stop", "€"),                          # stop char split in UTF-8
    (["E2", "AC", "a"], dict(max_tokens=3), "€a", "length", None),
    (["a", "ST"], dict(stop="STOP", max_tokens=2), "aST", "length", None),           # held text flushed at length
    (["ST", "OP"], dict(stop="STOP", max_tokens=2), "", "stop", "STOP"),            # stop beats length
    (["a", "\n", EOS], dict(stop="\n\n"), "a\n", "stop", EOS),                      # held text flushed at EOS
    (["a", "\n\n", "b"], dict(stop="\n"), "a", "stop", "\n"),
    (["a", IM_END, "b"], dict(max_tokens=3), "a", "stop", IM_END),                 # chat end token is a stop id
    (["a", IM_END, "b"], dict(max_tokens=3, skip_special_tokens=False, stop="<|im_end|>", eos=(EOS,)), "a", "stop",
     "<|im_end|>"),
    (["a", IM_END, "b"], dict(max_tokens=3, skip_special_tokens=True, stop="<|im_end|>", eos=(EOS,)), "ab", "length",
     None),
]


@pytest.mark.parametrize("tokens, params, text, reason, stop_reason", CASES)
def test_table(tokens, params, text, reason, stop_reason):
    params = dict(params)
    eos = params.pop("eos", (EOS, IM_END))
    checker, deltas, results = run(tokens, eos=eos, **params)
    assert checker.text == text
    assert (checker.finish_reason, checker.stop_reason) == (reason, stop_reason)
    assert (results[-1].finish_reason, results[-1].stop_reason) == (reason, stop_reason)
    assert all(not r.finished for r in results[:-1])


def test_hold_back_then_release_deltas():
    _, deltas, _ = run(["a", "ST", "a", "b"], stop="STOP", max_tokens=4)
    assert deltas == ["a", "", "STa", "b"]
    _, deltas, _ = run(["E2", "AC"], max_tokens=2)
    assert deltas == ["", "€"]                                       # never half a character


def test_append_after_finish_and_abort():
    checker, _, _ = run(["a", EOS])
    with pytest.raises(ValueError, match="finished"):
        checker.append(ID["a"])
    c = StopChecker(ToyTokenizer(), SamplingParams(stop="STOP"), {EOS})
    assert c.append(ID["a"]).delta_text == "a"
    assert c.append(ID["ST"]).delta_text == ""
    res = c.finish("abort")
    assert (res.delta_text, res.finish_reason, c.text) == ("ST", "abort", "aST")


def test_engine_max_tokens_override():
    c = StopChecker(ToyTokenizer(), SamplingParams(max_tokens=None), {EOS}, max_tokens=2)
    assert not c.append(ID["a"]).finished
    assert c.append(ID["b"]).finish_reason == "length"


def test_helpers():
    assert holdback_len("xxST", ["STOP", "SX"]) == 2
    assert holdback_len("xxS", ["STOP", "SX"]) == 1
    assert holdback_len("STOP", ["STOP"]) == 0                       # a whole stop string is not "held"
    assert holdback_len("anything", []) == 0
    assert find_stop("xabcx", ["bc", "abc"]) == (1, "abc")              # both end at 4: the longer one
    assert find_stop("xyz", ["q"]) is None


# --- the real SmolLM2 tokenizer -------------------------------------------------------------------
TEXTS = [
    "The capital of France is Paris. It is known for the Eiffel Tower and the Louvre museum.",
    "def add(a, b):\n    return a + b\n\n\nprint(add(2, 3))  # 5\n",
    "Caf\u00e9 cr\u00e8me br\u00fbl\u00e9e \u2014 na\u00efve \u00fcber "
    "\u65e5\u672c\u8a9e\u306e\u6587 \U0001F600\U0001F680 done.",
    "User: hi\nAssistant: Hello! How can I help you today?\nUser: ###\nAssistant:",
]


@pytest.fixture(scope="module")
def tok():
    from pyengine.model_files import default_model_path
    from pyengine.tokenizer import Tokenizer
    return Tokenizer.from_gguf(default_model_path())


def feed(tok, ids, params, eos=()):
    checker = StopChecker(tok, params, set(eos))
    deltas = []
    for t in ids:
        res = checker.append(t)
        deltas.append(res.delta_text)
        if res.finished:
            break
    else:
        deltas.append(checker.finish("length").delta_text)
    assert "".join(deltas) == checker.text
    assert all("\ufffd" not in d for d in deltas)
    return checker, deltas


@pytest.mark.parametrize("text", TEXTS)
def test_real_tokenizer_plain_streaming(tok, text):
    ids = tok.encode(text)
    checker, deltas = feed(tok, ids, SamplingParams(max_tokens=None))
    assert checker.text == text == tok.decode(ids)


@pytest.mark.parametrize("text", TEXTS)
def test_real_tokenizer_stop_strings_anywhere(tok, text):
    rnd = random.Random(len(text))
    ids = tok.encode(text)
    # token boundaries in character offsets: choose stop strings that straddle them
    raw, bounds = b"", []
    for t in ids:
        raw += tok.token_bytes(t)
        bounds.append(len(raw.decode("utf-8", errors="ignore")))    # complete characters so far
    for _ in range(25):
        b = rnd.choice(bounds[:-1])
        start = max(0, b - rnd.randint(1, 4))
        stop = text[start:b + rnd.randint(1, 4)]
        cut = text.find(stop)
        for include in (False, True):
            params = SamplingParams(max_tokens=None, stop=[stop], include_stop_str_in_output=include)
            checker, _ = feed(tok, ids, params)
            assert checker.finish_reason == "stop" and checker.stop_reason == stop
            assert checker.text == text[:cut + (len(stop) if include else 0)], (stop, include)


def test_real_tokenizer_special_tokens(tok):
    ids = tok.encode("Hi there<|im_end|>", parse_special=True)
    im_end = ids[-1]
    assert tok.decode([im_end]) == "<|im_end|>"
    assert im_end in tok.stop_token_ids
    # as a stop id: ends the sequence, its text never shows
    checker, _ = feed(tok, ids + ids, SamplingParams(max_tokens=None), eos=tok.stop_token_ids)
    assert (checker.text, checker.finish_reason, checker.stop_reason) == ("Hi there", "stop", im_end)
    # ignored as a stop: skip_special_tokens decides whether its text appears
    checker, _ = feed(tok, ids + ids, SamplingParams(max_tokens=None, ignore_eos=True), eos=tok.stop_token_ids)
    assert checker.text == "Hi thereHi there"
    checker, _ = feed(tok, ids + ids, SamplingParams(max_tokens=None, ignore_eos=True, skip_special_tokens=False),
                      eos=tok.stop_token_ids)
    assert checker.text == "Hi there<|im_end|>Hi there<|im_end|>"
