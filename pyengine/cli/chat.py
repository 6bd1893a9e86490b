"""`pyengine chat`: an interactive chat REPL with streaming replies.

The whole conversation is re-sent each turn (the prefix cache makes the shared part cheap). When it
no longer fits the context, the oldest turns are dropped. Commands: /reset, /exit (or Ctrl-D);
Ctrl-C interrupts a reply and keeps the part already shown.
"""
from __future__ import annotations

import argparse
import sys
import time

from pyengine.cli.generate import add_sampling_arguments, load_llm, sampling_params, stream_to, summary

HELP = "chat with the model in the terminal (/reset clears the history, /exit quits)"
COMMANDS = "/reset  forget the conversation\n/exit   quit (also /quit, Ctrl-D)\n/help   this text"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_sampling_arguments(p, max_tokens=512)
    p.add_argument("--system", default=None, metavar="TEXT", help="system message")


def fit_history(llm, messages: list[dict], max_tokens: int) -> tuple[list[dict], list[int]]:
    """Drop the oldest user/assistant turns (never the system message or the newest user message)
    until the prompt leaves room for `max_tokens`. Returns (messages kept, prompt ids)."""
    tok = llm.get_tokenizer()
    msgs = list(messages)
    while True:
        ids = tok.encode(llm.chat_prompt(msgs), add_special_tokens=False)
        if len(ids) + max_tokens <= llm.max_model_len:
            return msgs, ids
        first = 1 if msgs and msgs[0]["role"] == "system" else 0
        if len(msgs) - first <= 1:
            raise ValueError(f"the message ({len(ids)} tokens) + max_tokens ({max_tokens}) does not fit "
                             f"max_model_len ({llm.max_model_len})")
        del msgs[first:first + 2 if len(msgs) - first > 2 else first + 1]


def run(args) -> int:
    params = sampling_params(args)
    interactive = sys.stdin.isatty()
    llm = load_llm(args)
    system = [{"role": "system", "content": args.system}] if args.system else []
    history: list[dict] = list(system)
    if interactive:
        try:
            import readline  # noqa: F401  (line editing and history for input(); absent on some platforms)
        except ImportError:
            pass
        print("type a message; /reset clears the history, /exit quits", file=sys.stderr)
    while True:
        try:
            line = input(">>> " if interactive else "")
        except EOFError:
            if interactive:
                print(file=sys.stderr)
            return 0
        except KeyboardInterrupt:          # at the prompt: a fresh line, not an exit
            print("\n(use /exit or Ctrl-D to quit)", file=sys.stderr)
            continue
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            return 0
        if text == "/reset":
            history = list(system)
            print("(conversation cleared)", file=sys.stderr)
            continue
        if text in ("/help", "/?"):
            print(COMMANDS, file=sys.stderr)
            continue
        try:
            kept, ids = fit_history(llm, history + [{"role": "user", "content": line}], params.max_tokens)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            continue
        if len(kept) < len(history) + 1:
            print(f"(dropped {len(history) + 1 - len(kept)} old messages to fit the context)", file=sys.stderr)
        start = time.perf_counter()
        stream = llm.stream({"prompt_token_ids": ids}, params)
        reply, interrupted = stream_to(stream)
        print(flush=True)
        if interrupted:
            print("[interrupted]", file=sys.stderr)
        if stream.output is not None:
            print(summary(stream.output, start, llm.get_tokenizer()), file=sys.stderr, flush=True)
        history = kept + [{"role": "assistant", "content": reply}]
