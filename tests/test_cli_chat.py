"""`pyengine chat`: one real turn through a subprocess, then the REPL's history, /reset and Ctrl-C
handling in-process with a shared model."""
import io
import subprocess
import sys

import pytest

from pyengine.cli import chat as chat_cli
from pyengine.cli import main
from pyengine.llm import LLM


def test_chat_repl_subprocess_one_turn():
    proc = subprocess.run(
        [sys.executable, "-m", "pyengine", "chat", "--temperature", "0", "--max-tokens", "12"],
        input="What is the capital of France?\n/exit\n", capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
    assert "loaded in" in proc.stderr and "tok/s" in proc.stderr
    assert "finish stop ('<|im_end|>')" in proc.stderr                # the reply ended itself


@pytest.fixture(scope="module")
def llm():
    return LLM(max_model_len=1024)


class Spy:
    """Wraps llm.stream: records each prompt; can raise KeyboardInterrupt after the first delta."""

    def __init__(self, llm, interrupt_turns=()):
        self.llm, self.prompts, self.interrupt_turns, self.streams = llm, [], set(interrupt_turns), []
        self.real_stream = llm.stream               # bound before the monkeypatch replaces it

    def __call__(self, prompt, params):
        self.prompts.append(list(prompt["prompt_token_ids"]))
        stream = self.real_stream(prompt, params)
        self.streams.append(stream)
        if len(self.prompts) - 1 not in self.interrupt_turns:
            return stream
        return Interrupting(stream)


class Interrupting:
    def __init__(self, stream):
        self.stream, self.n = stream, 0

    def __iter__(self):
        return self

    def __next__(self):
        self.n += 1
        if self.n == 2:
            raise KeyboardInterrupt          # what Ctrl-C does in the middle of a reply
        return next(self.stream)

    def close(self):
        self.stream.close()

    @property
    def output(self):
        return self.stream.output


def run_repl(monkeypatch, capsys, llm, lines, interrupt_turns=()):
    spy = Spy(llm, interrupt_turns)
    monkeypatch.setattr(chat_cli, "load_llm", lambda args: llm)
    monkeypatch.setattr(llm, "stream", spy)
    monkeypatch.setattr(sys, "stdin", io.StringIO("".join(line + "\n" for line in lines)))
    rc = main(["chat", "--temperature", "0", "--max-tokens", "6", "--system", "Be brief."])
    out, err = capsys.readouterr()
    return rc, out, err, spy


def test_history_kept_and_reset(monkeypatch, capsys, llm):
    tok = llm.get_tokenizer()
    rc, out, err, spy = run_repl(monkeypatch, capsys, llm,
                                 ["Name a colour.", "", "/help", "And another?", "/reset", "And another?", "/exit"])
    assert rc == 0 and len(spy.prompts) == 3
    first_reply = spy.streams[0].output.outputs[0].text
    second_prompt = tok.decode(spy.prompts[1])
    assert "Be brief." in second_prompt and "Name a colour." in second_prompt
    assert first_reply.strip() and first_reply.strip() in second_prompt          # the reply is in the history
    third_prompt = tok.decode(spy.prompts[2])
    assert "Name a colour." not in third_prompt and "Be brief." in third_prompt  # /reset keeps the system message
    assert spy.prompts[2] == llm.get_tokenizer().encode(llm.chat_prompt(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "And another?"}]))
    assert "conversation cleared" in err and "/reset" in err and err.count(" tok/s), prompt ") == 3


def test_ctrl_c_interrupts_reply_not_repl(monkeypatch, capsys, llm):
    rc, out, err, spy = run_repl(monkeypatch, capsys, llm, ["Tell me a long story.", "Hi", "/exit"],
                                 interrupt_turns=[0])
    assert rc == 0 and len(spy.prompts) == 2                     # the REPL went on to the next message
    assert "[interrupted" in err
    assert spy.streams[0].output.outputs[0].finish_reason == "abort"
    second = llm.get_tokenizer().decode(spy.prompts[1])
    assert "long story" not in second and "Hi" in second         # the cut-off turn is not in the history
    assert not llm.llm_engine.has_unfinished_requests()


def test_fit_history_drops_oldest_turns(llm):
    sys_msg = {"role": "system", "content": "S"}
    turns = []
    for i in range(40):
        turns += [{"role": "user", "content": f"question {i} " + "word " * 20},
                  {"role": "assistant", "content": f"answer {i} " + "word " * 20}]
    msgs = [sys_msg] + turns + [{"role": "user", "content": "last"}]
    kept, ids = chat_cli.fit_history(llm, msgs, 200)
    assert kept[0] == sys_msg and kept[-1]["content"] == "last"
    assert len(ids) + 200 <= llm.max_model_len and len(kept) < len(msgs)
    assert kept[1:] == msgs[len(msgs) - len(kept) + 1:]          # a suffix: the newest turns survive
    assert kept[1]["role"] == "user"
    with pytest.raises(ValueError, match="max_model_len"):
        chat_cli.fit_history(llm, [{"role": "user", "content": "word " * 1200}], 200)
