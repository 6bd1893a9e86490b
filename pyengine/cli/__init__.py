"""`pyengine` command line. Each subcommand lives in its own module and is imported only when used,
so `pyengine info` never pays for the server's imports.

A subcommand module defines ``HELP`` (one line), ``add_arguments(parser)`` and ``run(args) -> int``.
"""
from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS = {
    "info": "pyengine.cli.info",
    "generate": "pyengine.cli.generate",
    "chat": "pyengine.cli.chat",
    "bench": "pyengine.cli.bench",
    "serve": "pyengine.cli.serve",
    "web": "pyengine.cli.web",
    "perplexity": "pyengine.cli.perplexity",
    "quantize": "pyengine.cli.quantize",
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="pyengine", description="pure-NumPy LLM inference engine")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    # Only the chosen subcommand's module is imported; the others are listed by name.
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, module_name in SUBCOMMANDS.items():
        if name == chosen:
            module = importlib.import_module(module_name)
            p = sub.add_parser(name, help=module.HELP, description=module.HELP)
            module.add_arguments(p)
            p.set_defaults(_run=module.run)
        else:
            sub.add_parser(name, help=f"({name})")
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
    except (FileNotFoundError, ValueError) as exc:
        # GGUFError subclasses ValueError: user errors print one readable line, not a traceback.
        print(f"pyengine {args.command}: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
