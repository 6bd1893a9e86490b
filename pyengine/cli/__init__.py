"""`pyengine` command line. Each subcommand lives in its own module and is imported only when used,
so `pyengine info` never pays for the server's imports.

A subcommand module defines ``add_arguments(parser)`` and ``run(args) -> int``; its one-line help is
here, so `pyengine --help` describes every subcommand without importing any.
"""
from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS = {
    "info": ("pyengine.cli.info", "describe a GGUF model: architecture, sizes, tokenizer, quantization types"),
    "generate": ("pyengine.cli.generate", "generate a completion for PROMPT, streamed to stdout"),
    "chat": ("pyengine.cli.chat", "chat with the model in the terminal (/help lists the commands)"),
    "bench": ("pyengine.cli.bench", "run a benchmark (default: decode/prefill against the NumPy roofline)"),
    "serve": ("pyengine.cli.serve", "serve the OpenAI-compatible API (chat/completions, streaming, /metrics)"),
    "web": ("pyengine.cli.web", "serve the browser demo (Pyodide + TypeScript engines side by side)"),
    "perplexity": ("pyengine.cli.perplexity", "perplexity of a text file (llama.cpp's method), KL divergence"),
    "quantize": ("pyengine.cli.quantize", "write a GGUF with its tensors requantized (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K)"),
    "pull": ("pyengine.cli.pull", "download a GGUF: org/repo/file.gguf, org/repo[:QUANT] or an https:// URL"),
    "models": ("pyengine.cli.models", "list the models here (packaged, pulled, local) with size, arch and quant"),
    "rm": ("pyengine.cli.rm", "delete a pulled model"),
}


def version() -> str:
    from importlib import metadata
    try:
        return metadata.version("pyengine")
    except metadata.PackageNotFoundError:   # run from a checkout that was never installed
        return "unknown (not installed)"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="pyengine", description="pure-NumPy LLM inference engine",
                                     epilog="`pyengine COMMAND --help` shows a command's options.")
    parser.add_argument("--version", action="version", version=f"pyengine {version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    # Only the chosen subcommand's module is imported; the others are listed with their help line.
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, (module_name, help_line) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_line, description=help_line)
        if name == chosen:
            module = importlib.import_module(module_name)
            module.add_arguments(p)
            p.set_defaults(_run=module.run)
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    try:
        return int(args._run(args) or 0)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # `pyengine info | head` closed our stdout: not an error of ours. Point stdout at devnull so
        # the interpreter's final flush does not raise again.
        import os
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (OSError, ValueError) as exc:
        # GGUFError subclasses ValueError: user errors print one readable line, not a traceback.
        print(f"pyengine {args.command}: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
