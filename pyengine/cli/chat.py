"""`pyengine chat`: an interactive chat REPL with streaming replies.

The whole conversation is re-sent each turn (the prefix cache makes the shared part cheap). When it
no longer fits the context, the oldest turns are dropped. Message text is plain text (a typed
"<|im_end|>" is characters, not the control token). Ctrl-C interrupts a reply: the part shown stays on
screen but neither it nor its question enters the history. `\"\"\"` starts and ends a multi-line message
(as does a line ending in a backslash); /commands are never sent to the model.
"""
from __future__ import annotations

import argparse
import sys
import time

from pyengine.cli.generate import (SAMPLING_OPTIONS, add_sampling_arguments, context_hint, load_llm, report,
                                   sampling_params, stream_to, summary)
from pyengine.engine import prompt_cache

COMMANDS = """/reset            forget the conversation (keeps --system)
/set NAME VALUE    change a setting: temperature, top_p, top_k, min_p, repetition_penalty, max_tokens, seed
/set               show the settings
/exit              quit (also /quit, Ctrl-D)
/help              this text
\"\"\"                start or end a multi-line message (or end a line with \\ to continue it)"""
SETTINGS = SAMPLING_OPTIONS + ("max_tokens", "seed")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_sampling_arguments(p, max_tokens=512)
    prompt_cache.add_argument(p)
    p.add_argument("--system", default=None, metavar="TEXT", help="system message")


def fit_history(llm, messages: list[dict], max_tokens: int) -> tuple[list[dict], list[int]]:
    """Drop the oldest user/assistant turns (never the system message or the newest user message)
    until the prompt leaves room for `max_tokens`. Returns (messages kept, prompt ids)."""
    tok = llm.get_tokenizer()
    msgs = list(messages)
    while True:
        _, ids = tok.encode_chat(msgs)
        if len(ids) + max_tokens <= llm.max_model_len:
            return msgs, ids
        first = 1 if msgs and msgs[0]["role"] == "system" else 0
        if len(msgs) - first <= 1:
            raise ValueError(f"the message ({len(ids)} tokens) + max_tokens ({max_tokens}) does not fit "
                             f"max_model_len ({llm.max_model_len}): "
                             f"{context_hint(llm.max_model_len, getattr(llm, 'model_context', None))}")
        del msgs[first:first + 2 if len(msgs) - first > 2 else first + 1]


def apply_setting(params, words: list[str]):
    """`/set temperature 0.2` -> new SamplingParams (ValueError with the reason otherwise)."""
    if len(words) != 2 or words[0] not in SETTINGS:
        raise ValueError(f"usage: /set NAME VALUE, NAME one of {', '.join(SETTINGS)}")
    name, raw = words
    kind = int if name in ("top_k", "max_tokens", "seed") else float
    try:
        value = None if (name == "seed" and raw.lower() == "none") else kind(raw)
    except ValueError:
        raise ValueError(f"{name} needs a{'n integer' if kind is int else ' number'}, got {raw!r}") from None
    return params.clone(**{name: value})


def read_message(first: str, read) -> str:
    """The whole message that starts with line `first`: a \"\"\" block, or lines continued by a backslash."""
    if first.strip().startswith('"""'):
        rest = first.strip()[3:]
        if rest.endswith('"""'):
            return rest[:-3]
        lines = [rest] if rest else []
        while True:
            line = read("... ")
            if line.rstrip().endswith('"""'):
                lines.append(line.rstrip()[:-3])
                return "\n".join(lines).strip("\n")
            lines.append(line)
    lines = [first]
    while lines[-1].endswith("\\"):
        lines[-1] = lines[-1][:-1]
        lines.append(read("... "))
    return "\n".join(lines)


def run(args) -> int:
    sampling_params(args)                # bad values fail before the model loads
    interactive = sys.stdin.isatty()
    llm = load_llm(args)
    params = sampling_params(args, llm)
    system = [{"role": "system", "content": args.system}] if args.system else []
    history: list[dict] = list(system)
    if interactive:
        try:
            import readline  # noqa: F401  (line editing and history for input(); absent on some platforms)
        except ImportError:
            pass
        print("type a message; /help lists the commands, /exit quits", file=sys.stderr)

    def read(prompt: str) -> str:
        return input(prompt if interactive else "")

    while True:
        try:
            text = read_message(read(">>> "), read)
        except EOFError:
            if interactive:
                print(file=sys.stderr)
            return 0
        except KeyboardInterrupt:          # at the prompt: a fresh line, not an exit
            print("\n(use /exit or Ctrl-D to quit)", file=sys.stderr)
            continue
        if not text.strip():
            continue
        if text.startswith("/"):
            words = text.split()
            command = words[0]
            if command in ("/exit", "/quit"):
                return 0
            if command == "/reset":
                history = list(system)
                print("(conversation cleared)", file=sys.stderr)
            elif command in ("/help", "/?"):
                print(COMMANDS, file=sys.stderr)
            elif command == "/set" and len(words) == 1:
                print("  ".join(f"{k}={getattr(params, k)}" for k in SETTINGS), file=sys.stderr)
            elif command == "/set":
                try:
                    params = apply_setting(params, words[1:])
                    print(f"(set {words[1]} = {getattr(params, words[1])})", file=sys.stderr)
                except ValueError as exc:
                    print(f"error: {exc}", file=sys.stderr)
            else:
                print(f"unknown command {command}; /help lists the commands (start a message with a space "
                      f"to send a leading '/')", file=sys.stderr)
            continue
        try:
            kept, ids = fit_history(llm, history + [{"role": "user", "content": text}], params.max_tokens)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            continue
        if len(kept) < len(history) + 1:
            print(f"(dropped {len(history) + 1 - len(kept)} old messages to fit the context)", file=sys.stderr)
        report(prompt_cache.before_run(llm.llm_engine, getattr(args, "prompt_cache", None)))
        start = time.perf_counter()
        stream = llm.stream({"prompt_token_ids": ids}, params)
        reply, interrupted = stream_to(stream)
        report(prompt_cache.after_run(llm.llm_engine, getattr(args, "prompt_cache", None), ids))
        print(flush=True)
        if stream.output is not None:
            print(summary(stream.output, start, llm.get_tokenizer()), file=sys.stderr, flush=True)
        if interrupted:    # a cut-off reply would steer the next ones: forget the whole turn
            print("[interrupted: this turn is not kept in the conversation]", file=sys.stderr)
            continue
        history = kept + [{"role": "assistant", "content": reply}]
