"""`pyengine generate PROMPT`: stream a completion to stdout; timings go to stderr.

Sampling options left out take the model's recommendations (its GGUF's ``general.sampling.*``), else
vLLM's defaults (temperature 1, top-p 1, top-k off, min-p 0): the same defaults as the Python API and the
server. ``--temperature 0`` is greedy. ``--chat`` wraps the prompt as a user message in the chat template.
``--max-model-len`` defaults to the model's trained context when one sequence's KV cache fits the memory.
"""
from __future__ import annotations

import argparse
import sys
import time

from pyengine.engine import prompt_cache
from pyengine.engine.args import EngineArgs, default_max_model_len  # noqa: F401  (default_max_model_len: its home)
from pyengine.engine.kv_cache import PagedKVCache

MODEL_DEFAULT = "default: the model's, else "
SAMPLING_OPTIONS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """--model, --max-model-len, --kv-cache-dtype, --enforce-eager, --weights, --threads (every engine command)."""
    EngineArgs.add_cli_args(p, ("model",))


def add_sampling_arguments(p: argparse.ArgumentParser, max_tokens: int) -> None:
    """Options shared by `generate` and `chat`."""
    add_model_arguments(p)
    p.add_argument("--max-tokens", type=int, default=max_tokens, metavar="N", help=f"default {max_tokens}")
    p.add_argument("--temperature", type=float, default=None, metavar="T", help=f"0 = greedy ({MODEL_DEFAULT}1.0)")
    p.add_argument("--top-p", type=float, default=None, metavar="P", help=f"nucleus sampling ({MODEL_DEFAULT}1.0)")
    p.add_argument("--top-k", type=int, default=None, metavar="K", help=f"-1 = off ({MODEL_DEFAULT}-1)")
    p.add_argument("--min-p", type=float, default=None, metavar="P", help=f"0 = off ({MODEL_DEFAULT}0)")
    p.add_argument("--repetition-penalty", type=float, default=None, metavar="R", help=f"1 = off ({MODEL_DEFAULT}1)")
    p.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")
    p.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help="stop string (repeat for several)")
    p.add_argument("--min-tokens", type=int, default=0, metavar="N",
                   help="no end-of-sequence, stop token or stop string before N tokens (default 0)")
    p.add_argument("--bad-words", action="append", default=None, metavar="WORD",
                   help="never generate WORD (its token sequences, with and without a leading space; repeat)")
    add_speculative_argument(p)


def add_speculative_argument(p: argparse.ArgumentParser) -> None:
    EngineArgs.add_cli_args(p, ("speculative",))


def add_target_itl_argument(p: argparse.ArgumentParser) -> None:
    EngineArgs.add_cli_args(p, ("target_itl",))


def check_target_itl(args) -> None:
    """--target-itl-ms must be a finite number >= 0 (checked before the model loads)."""
    if getattr(args, "target_itl_ms", None) is not None:
        from pyengine.engine.chunk_budget import check_target_itl_ms
        try:
            check_target_itl_ms(args.target_itl_ms)
        except ValueError:
            raise ValueError(f"--target-itl-ms must be a finite number of ms >= 0 (0 = off), "
                             f"got {args.target_itl_ms}") from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", nargs="?", default=None,
                   help="prompt text (use --chat to send it as a user message); - or none: read standard input")
    p.add_argument("-f", "--prompt-file", default=None, metavar="FILE", help="read the prompt from FILE (- : stdin)")
    add_sampling_arguments(p, max_tokens=128)
    p.add_argument("--chat", action="store_true", help="apply the chat template to PROMPT")
    p.add_argument("--system", default=None, metavar="TEXT", help="system message (with --chat)")
    p.add_argument("--ignore-eos", action="store_true", help="keep going past end-of-sequence")
    add_target_itl_argument(p)
    prompt_cache.add_argument(p)


def sampling_params(args, llm=None, **extra):
    """SamplingParams from the options given, the rest from `llm`'s defaults (the model's, else vLLM's).
    Without `llm` it only checks the options (bad values fail before the model loads)."""
    from pyengine.sampling_params import SamplingParams
    given = {k: getattr(args, k) for k in SAMPLING_OPTIONS if getattr(args, k) is not None}
    base = {}
    if llm is not None:
        d = llm.get_default_sampling_params()
        base = {k: getattr(d, k) for k in SAMPLING_OPTIONS}
    return SamplingParams(**{**base, **given}, max_tokens=args.max_tokens, seed=args.seed, stop=args.stop,
                          min_tokens=args.min_tokens, bad_words=args.bad_words, **extra)


def context_hint(max_model_len: int, context: int | None) -> str:
    more = f", up to the model's {context}" if context and context > max_model_len else ""
    return f"the context is --max-model-len {max_model_len}{more}"


def load_llm(args):
    """Build the `LLM` stage by stage (file, weights + KV cache, tokenizer), reporting each on stderr."""
    import os

    from pyengine.engine.executor import LocalExecutor
    from pyengine.engine.threads import apply_threads, describe
    from pyengine.llm import LLM

    # one conversation at a time: size the KV cache and batch for a single sequence, logits rows for
    # 1 + up to 16 drafts verified per step (S14)
    eargs = EngineArgs.from_cli_args(args, max_num_seqs=1, max_logits=17).validate()   # fails before loading

    def stage(label: str, t: float) -> float:
        now = time.perf_counter()
        print(f"  {label} ({now - t:.2f} s)", file=sys.stderr, flush=True)
        return now

    path = eargs.model = eargs.model_path()
    print(f"loading {os.path.basename(path)} ({os.path.getsize(path) / 2**20:.0f} MB) ...", file=sys.stderr,
          flush=True)
    t0 = t = time.perf_counter()
    given = eargs.max_model_len
    try:
        gguf = eargs.load_model()
    except ValueError:
        if given is not None and eargs.model_context and given > eargs.model_context:
            raise ValueError(f"--max-model-len {given} exceeds the model's context length "
                             f"{eargs.model_context}") from None
        raise
    args.max_model_len = eargs.max_model_len
    eargs.threads = apply_threads(eargs.threads)
    t = stage(f"read {len(gguf.tensors)} tensors' headers; context {eargs.max_model_len} of {eargs.model_context}; "
              f"{describe()}", t)
    runner = eargs.create_runner(gguf)
    c = runner.config
    kv_bytes = runner.num_blocks * PagedKVCache.bytes_per_block(c.n_layers, runner.block_size, c.n_kv_heads,
                                                               c.head_dim, runner.kv_cache_dtype)
    t = stage(f"weights: {c.arch}, {c.n_layers} layers, d={c.d_model} ({eargs.weights_mode}); KV cache "
              f"{runner.num_blocks} blocks of {runner.block_size} tokens ({runner.kv_cache_dtype}) = "
              f"{kv_bytes / 2**20:.1f} MiB, one {eargs.max_model_len}-token sequence", t)
    tok = runner.tokenizer
    stage(f"tokenizer: {tok.vocab_size} tokens", t)
    llm = LLM.from_engine_args(eargs, LocalExecutor(runner))
    llm.model_context = eargs.model_context
    spec = eargs.speculative_config
    if spec is not None:
        stage(f"speculative decoding: {spec['method']}, up to {spec['num_speculative_tokens']} drafts a step", t)
    print(f"loaded in {time.perf_counter() - t0:.2f} s", file=sys.stderr, flush=True)
    return llm


def stream_to(stream, out=None) -> tuple[str, bool]:
    """Write a `TextStream`'s deltas to `out` as they come. Returns (text, interrupted): Ctrl-C aborts
    the request and returns what was shown so far."""
    out = out or sys.stdout
    try:
        for delta in stream:
            out.write(delta)
            out.flush()
    except KeyboardInterrupt:
        stream.close()
        return (stream.output.outputs[0].text if stream.output else ""), True
    return stream.output.outputs[0].text, False


def summary(output, start: float, tokenizer=None) -> str:
    """`N tokens in X s (Y tok/s), prompt P tokens, ...` for stderr (a stop token shown as its text)."""
    elapsed = time.perf_counter() - start
    comp = output.outputs[0]
    n = len(comp.token_ids)
    m = output.metrics
    parts = [f"{n} tokens in {elapsed:.2f} s ({n / max(elapsed, 1e-9):.1f} tok/s)",
             f"prompt {len(output.prompt_token_ids)} tokens"]
    if m is not None and m.ttft is not None:
        parts.append(f"first token {m.ttft * 1000:.0f} ms")
        if m.finished_time is not None and n > 1:
            decode = m.finished_time - m.first_token_time
            parts.append(f"decode {(n - 1) / max(decode, 1e-9):.1f} tok/s")
    if m is not None and m.num_drafts:
        parts.append(f"spec {m.num_accepted_tokens}/{m.num_draft_tokens} drafts accepted, "
                     f"mean acceptance length {m.mean_acceptance_length:.2f}")
    why = comp.stop_reason
    if isinstance(why, int) and tokenizer is not None:
        why = tokenizer.decode([why])
    parts.append(f"finish {comp.finish_reason}" + (f" ({why!r})" if why is not None else ""))
    return "[" + ", ".join(parts) + "]"


def check_fits(llm, n_prompt: int, max_tokens: int) -> None:
    """The overflow error a user can act on: it names the flags."""
    if n_prompt + max_tokens > llm.max_model_len:
        raise ValueError(f"the prompt ({n_prompt} tokens) + --max-tokens {max_tokens} does not fit: "
                         f"{context_hint(llm.max_model_len, getattr(llm, 'model_context', None))}")


def report(line: str | None) -> None:
    if line:
        print(line, file=sys.stderr, flush=True)


def read_prompt(args, stdin=None) -> str:
    """The prompt: the argument, else -f FILE, else standard input (``-`` either way); ValueError if none."""
    stdin = stdin if stdin is not None else sys.stdin
    if args.prompt is not None and args.prompt_file is not None:
        raise ValueError("give the prompt as an argument or with -f FILE, not both")
    source = args.prompt_file if args.prompt_file is not None else (args.prompt if args.prompt == "-" else None)
    if args.prompt is not None and args.prompt != "-":
        return args.prompt
    if source is None and stdin.isatty():
        raise ValueError("no prompt: give it as an argument, with -f FILE, or on standard input")
    if source is None or source == "-":
        text = stdin.read()
    else:
        with open(source, encoding="utf-8") as f:
            text = f.read()
    if not text.strip():
        raise ValueError("the prompt is empty" + (f" ({source} holds no text)" if source not in (None, "-") else ""))
    return text[:-1] if text.endswith("\n") else text      # a file's final newline is not part of the prompt


def run(args) -> int:
    args.prompt = read_prompt(args)
    sampling_params(args)                # bad values fail before the model loads
    check_target_itl(args)
    llm = load_llm(args)
    params = sampling_params(args, llm, ignore_eos=args.ignore_eos)
    tok = llm.get_tokenizer()
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        text, ids = tok.encode_chat(messages + [{"role": "user", "content": args.prompt}])
        prompt = {"prompt_token_ids": ids, "prompt": text}
    else:
        prompt = args.prompt
        try:
            ids = tok.encode(prompt, limit=llm.max_model_len)
        except ValueError as exc:     # TooManyTokens: stopped early, the prompt alone is too long
            raise ValueError(f"the prompt is too long ({exc}): "
                             f"{context_hint(llm.max_model_len, getattr(llm, 'model_context', None))}") from None
    check_fits(llm, len(ids), params.max_tokens)
    report(prompt_cache.before_run(llm.llm_engine, getattr(args, "prompt_cache", None)))
    start = time.perf_counter()
    stream = llm.stream(prompt, params)
    text, interrupted = stream_to(stream)
    if stream.output is not None:
        report(prompt_cache.after_run(llm.llm_engine, getattr(args, "prompt_cache", None),
                                      stream.output.prompt_token_ids))
    if not text.endswith("\n"):
        sys.stdout.write("\n")
    sys.stdout.flush()
    if stream.output is not None:
        print(summary(stream.output, start, llm.get_tokenizer()), file=sys.stderr)
    return 130 if interrupted else 0
