"""`pyengine generate`: streamed completion on stdout, timings on stderr, clean errors.

The first test loads the model the way the command does; the others reuse one loaded model
(monkeypatched `load_llm`) to keep the suite fast, still going through the whole command."""
import pytest

from pyengine.cli import generate as generate_cli
from pyengine.cli import main
from pyengine.llm import LLM


def test_generate_greedy_paris(capsys):
    rc = main(["generate", "The capital of France is", "--temperature", "0", "--max-tokens", "6"])
    out, err = capsys.readouterr()
    assert rc == 0
    assert out.splitlines()[0].startswith(" Paris.")
    assert "tok/s" in err and "loaded" in err
    assert "tok/s" not in out


@pytest.fixture(scope="module")
def shared_llm():
    return LLM(max_model_len=2048)


@pytest.fixture
def llm(monkeypatch, shared_llm):
    monkeypatch.setattr(generate_cli, "load_llm", lambda args: shared_llm)
    return shared_llm


def test_generate_stop_and_chat(capsys, llm):
    rc = main(["generate", "The capital of France is", "--temperature", "0", "--max-tokens", "4", "--stop", "."])
    out, err = capsys.readouterr()
    assert rc == 0 and out == " Paris\n" and "finish stop ('.')" in err
    rc = main(["generate", "What is the capital of France?", "--chat", "--temperature", "0", "--max-tokens", "12"])
    out, err = capsys.readouterr()
    assert rc == 0 and "Paris" in out and "<|im" not in out


def test_generate_seeded_sampling_is_reproducible(capsys, llm):
    args = ["generate", "Once upon a time", "--seed", "7", "--max-tokens", "6", "--temperature", "1.0"]
    assert main(args) == 0
    first = capsys.readouterr().out
    assert main(args) == 0
    assert capsys.readouterr().out == first and first.strip()


@pytest.mark.parametrize("flag, value, name", [("--temperature", "-1", "temperature"), ("--top-p", "0", "top_p"),
                                              ("--max-tokens", "0", "max_tokens"), ("--min-p", "2", "min_p"),
                                              ("--target-itl-ms", "-5", "target-itl-ms")])
def test_bad_option_fails_before_loading(capsys, flag, value, name):
    rc = main(["generate", "hi", flag, value])
    out, err = capsys.readouterr()
    assert rc == 1 and name in err and "loading" not in err and out == ""


def test_missing_model_file(capsys):
    rc = main(["generate", "hi", "--model", "/nonexistent/model.gguf"])
    assert rc == 1 and "not found" in capsys.readouterr().err


def test_prompt_from_a_file_or_standard_input(capsys, llm, monkeypatch, tmp_path):
    """Issue 33: -f FILE and standard input (`-`, or no argument with stdin not a terminal) give the same
    answer as the argument; nothing at all is a clear error."""
    import io
    want = main(["generate", "The capital of France is", "--temperature", "0", "--max-tokens", "4"]) or \
        capsys.readouterr().out
    path = tmp_path / "q.txt"
    path.write_text("The capital of France is\n")          # a file's final newline is not part of the prompt
    assert main(["generate", "-f", str(path), "--temperature", "0", "--max-tokens", "4"]) == 0
    assert capsys.readouterr().out == want
    for argv in (["generate", "-"], ["generate"]):
        monkeypatch.setattr("sys.stdin", io.StringIO("The capital of France is"))
        assert main(argv + ["--temperature", "0", "--max-tokens", "4"]) == 0
        assert capsys.readouterr().out == want
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    assert main(["generate", "--max-tokens", "4"]) == 1
    assert "the prompt is empty" in capsys.readouterr().err
    assert main(["generate", "x", "-f", str(path)]) == 1
    assert "not both" in capsys.readouterr().err


def test_speculative_config_shorthand_and_kv_memory_line(capsys):
    """`--speculative-config ngram[:K]` without JSON; the loading line gives the KV cache's memory, which
    q8_0 makes 3.8x smaller for the same blocks."""
    from pyengine.engine.spec_decode import parse_speculative_config
    assert parse_speculative_config("ngram") == {"method": "ngram", "num_speculative_tokens": 4}
    assert parse_speculative_config("ngram:6") == {"method": "ngram", "num_speculative_tokens": 6}
    with pytest.raises(ValueError, match="not valid JSON .* nor ngram"):
        parse_speculative_config("draft_model")
    mib = {}
    for kv in ("auto", "q8_0"):
        rc = main(["generate", "The capital of France is", "--temperature", "0", "--max-tokens", "3",
                   "--max-model-len", "512", "--kv-cache-dtype", kv, "--speculative-config", "ngram"])
        out, err = capsys.readouterr()
        assert rc == 0 and out.startswith(" Paris"), (out, err)
        assert "speculative decoding: ngram, up to 4 drafts a step" in err
        import re
        m = re.search(rf"KV cache (\d+) blocks of 16 tokens \({kv}\) = ([\d.]+) MiB, one 512-token sequence", err)
        assert m, err
        mib[kv] = (int(m.group(1)), float(m.group(2)))
    assert mib["auto"][0] == mib["q8_0"][0] == 32
    assert 3.7 < mib["auto"][1] / mib["q8_0"][1] < 3.9
