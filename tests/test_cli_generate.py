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
