"""`pyengine generate PROMPT`: stream a completion to stdout; timings go to stderr.

Sampling defaults are llama.cpp's (temperature 0.8, top-k 40, top-p 0.95, min-p 0.05);
``--temperature 0`` is greedy. ``--chat`` wraps the prompt as a user message in the chat template.
"""
from __future__ import annotations

import argparse
import sys
import time

HELP = "generate a completion for PROMPT, streamed to stdout"


def add_sampling_arguments(p: argparse.ArgumentParser, max_tokens: int) -> None:
    """Options shared by `generate` and `chat`."""
    from pyengine.engine.kv_cache import KV_DTYPES
    p.add_argument("--model", metavar="PATH", default=None, help="GGUF file (default: SmolLM2-135M-Instruct)")
    p.add_argument("--max-tokens", type=int, default=max_tokens, metavar="N", help=f"default {max_tokens}")
    p.add_argument("--temperature", type=float, default=0.8, metavar="T", help="0 = greedy (default 0.8)")
    p.add_argument("--top-p", type=float, default=0.95, metavar="P", help="nucleus sampling (default 0.95)")
    p.add_argument("--top-k", type=int, default=40, metavar="K", help="-1 = off (default 40)")
    p.add_argument("--min-p", type=float, default=0.05, metavar="P", help="0 = off (default 0.05)")
    p.add_argument("--repetition-penalty", type=float, default=1.0, metavar="R", help="default 1.0 (off)")
    p.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")
    p.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help="stop string (repeat for several)")
    p.add_argument("--max-model-len", type=int, default=2048, metavar="N", help="context size (default 2048)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_DTYPES,
                   help="KV cache storage: auto (float32), fp16, q8_0, q4_0 (S08)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", help="prompt text (use --chat to send it as a user message)")
    add_sampling_arguments(p, max_tokens=128)
    p.add_argument("--chat", action="store_true", help="apply the chat template to PROMPT")
    p.add_argument("--system", default=None, metavar="TEXT", help="system message (with --chat)")
    p.add_argument("--ignore-eos", action="store_true", help="keep going past end-of-sequence")


def sampling_params(args, **extra):
    from pyengine.sampling_params import SamplingParams
    return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                          max_tokens=args.max_tokens, seed=args.seed, stop=args.stop,
                          repetition_penalty=args.repetition_penalty, **extra)


def load_llm(args):
    """Build the `LLM` stage by stage (file, weights + KV cache, tokenizer), reporting each on stderr."""
    import os

    from pyengine.config import ModelConfig
    from pyengine.engine.model_runner import ModelRunner
    from pyengine.gguf.reader import GGUFFile
    from pyengine.llm import LLM
    from pyengine.model_files import resolve_model

    def stage(label: str, t: float) -> float:
        now = time.perf_counter()
        print(f"  {label} ({now - t:.2f} s)", file=sys.stderr, flush=True)
        return now

    path = resolve_model(args.model)
    print(f"loading {os.path.basename(path)} ({os.path.getsize(path) / 2**20:.0f} MB) ...", file=sys.stderr,
          flush=True)
    t0 = t = time.perf_counter()
    gguf = GGUFFile(path)
    context = ModelConfig.from_gguf(gguf).context_length
    if args.max_model_len > context:
        raise ValueError(f"--max-model-len {args.max_model_len} exceeds the model's context length {context}")
    t = stage(f"read {len(gguf.tensors)} tensors' headers", t)
    # one conversation at a time: size the KV cache and batch for a single sequence
    runner = ModelRunner(gguf, max_model_len=args.max_model_len, max_num_seqs=1,
                         kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"))
    c = runner.config
    t = stage(f"weights: {c.arch}, {c.n_layers} layers, d={c.d_model}; KV cache {runner.num_blocks} blocks "
              f"({runner.kv_cache_dtype})", t)
    tok = runner.tokenizer
    stage(f"tokenizer: {tok.vocab_size} tokens", t)
    llm = LLM(runner=runner, max_model_len=args.max_model_len, max_num_seqs=1)
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
    why = comp.stop_reason
    if isinstance(why, int) and tokenizer is not None:
        why = tokenizer.decode([why])
    parts.append(f"finish {comp.finish_reason}" + (f" ({why!r})" if why is not None else ""))
    return "[" + ", ".join(parts) + "]"


def run(args) -> int:
    params = sampling_params(args, ignore_eos=args.ignore_eos)   # bad values fail before the model loads
    llm = load_llm(args)
    prompt = args.prompt
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        prompt = llm.chat_prompt(messages + [{"role": "user", "content": args.prompt}])
    start = time.perf_counter()
    stream = llm.stream(prompt, params)
    text, interrupted = stream_to(stream)
    if not text.endswith("\n"):
        sys.stdout.write("\n")
    sys.stdout.flush()
    if stream.output is not None:
        print(summary(stream.output, start, llm.get_tokenizer()), file=sys.stderr)
    return 130 if interrupted else 0
