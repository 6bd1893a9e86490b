"""`ServerArgs`: every option of the HTTP server itself, beside the engine's `EngineArgs` (vLLM keeps its frontend
args beside its engine args the same way).

    p = argparse.ArgumentParser(); ServerArgs.add_cli_args(p, ServerArgs.GROUPS); EngineArgs.add_cli_args(p, ...)
    args = p.parse_args(argv)
    server, engine = ServerArgs.from_cli_args(args).validate(), EngineArgs.from_cli_args(args).validate()

One place for the server's flags (their spellings, defaults and help, in groups so `pyengine serve --help` keeps its
order around the engine's flags), their checks (`validate`: a clear message before anything loads) and the
connection limits they make (`limits`, a `ServerLimits`). `pyengine serve` and the S18 disaggregated launcher build
it once from their command line and pass it down; `server.app.create_app_from_args` builds the app from it.

Plain data, no starlette: the CLI describes these flags before the server extras are installed.
"""
from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass, field

from pyengine.server.limits import ServerLimits
from pyengine.structured.budget import DEFAULT_COMPILE_S, DEFAULT_MAX_STATES

MAX_BODY_BYTES = 1 << 20


@dataclass
class ServerArgs:
    """The options of one server (``pyengine serve``'s flags of the same names; the limits' are `ServerLimits`')."""
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None     # the model id clients send (default: the file name)
    prompt_cache_dir: str | None = None      # S21: /prompt_cache/* keep prompt KV files here (off without it)
    api_key: str | None = None
    max_body_bytes: int = MAX_BODY_BYTES
    max_grammar_compile_s: float = DEFAULT_COMPILE_S
    max_grammar_states: int = DEFAULT_MAX_STATES
    with_demo: bool = False
    log_level: str = "info"
    prefill_instances: int = 0               # S18: both > 0 disaggregate (router + instances as MPI ranks)
    decode_instances: int = 0
    prefill_tensor_parallel_size: int | None = None   # None: the engine's --tensor-parallel-size
    decode_tensor_parallel_size: int | None = None
    limits: ServerLimits = field(default_factory=ServerLimits)

    GROUPS = ("listen", "api", "disagg", "limits")

    # --- checks --------------------------------------------------------------------------------------
    @property
    def disaggregated(self) -> bool:
        return bool(self.prefill_instances or self.decode_instances)

    def role_tp(self, tensor_parallel_size: int) -> tuple[int, int]:
        """(prefill, decode) instances' tensor-parallel sizes: the role's own flag, else the engine's size."""
        pre, dec = self.prefill_tensor_parallel_size, self.decode_tensor_parallel_size
        return (tensor_parallel_size if pre is None else pre), (tensor_parallel_size if dec is None else dec)

    def validate(self) -> "ServerArgs":
        """ValueError naming the first bad option by its flag (before anything loads); returns self."""
        lim = self.limits
        if not _is_int(self.port) or not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be 0..65535, got {self.port!r}")
        for flag, v, least in (("--max-body-bytes", self.max_body_bytes, 1),
                               ("--max-grammar-states", self.max_grammar_states, 1),
                               ("--max-connections", lim.max_connections, 1),
                               ("--max-uploads-per-client", lim.max_uploads_per_client, 1),
                               ("--max-waiting", lim.max_waiting, 0),
                               ("--max-waiting-tokens", lim.max_waiting_tokens, 1),
                               ("--max-tokens-per-request", lim.max_tokens_per_request, 1),
                               ("--prefill-instances", self.prefill_instances, 0),
                               ("--decode-instances", self.decode_instances, 0),
                               ("--prefill-tensor-parallel-size", self.prefill_tensor_parallel_size, 1),
                               ("--decode-tensor-parallel-size", self.decode_tensor_parallel_size, 1)):
            if v is not None and (not _is_int(v) or v < least):
                raise ValueError(f"{flag} must be an integer >= {least}, got {v!r}")
        for flag, v, zero_ok in (("--max-grammar-compile-s", self.max_grammar_compile_s, False),
                                 ("--body-timeout", lim.body_timeout, False),
                                 ("--header-timeout", lim.header_timeout, False),
                                 ("--keep-alive-timeout", lim.keep_alive_timeout, False),
                                 ("--body-first-byte-timeout", lim.body_first_byte_timeout, False),
                                 ("--shutdown-timeout", lim.shutdown_timeout, True),
                                 ("--stats-interval", lim.stats_interval, True)):
            if not (isinstance(v, (int, float)) and math.isfinite(v) and (v > 0 or zero_ok and v == 0)):
                raise ValueError(f"{flag} must be a {'non-negative' if zero_ok else 'positive'} number of "
                                 f"seconds, got {v!r}")
        if self.disaggregated and self.prompt_cache_dir is not None:
            raise ValueError("--prompt-cache-dir is not served by a disaggregated server (--prefill-instances / "
                             "--decode-instances): its router holds no KV cache")
        return self

    # --- the command line ----------------------------------------------------------------------------
    @staticmethod
    def add_cli_args(p: argparse.ArgumentParser, groups=GROUPS) -> argparse.ArgumentParser:
        """The server's flags. ``groups``: "listen" (--host, --port), "api" (model id, prompt cache, key, waiting
        bounds), "disagg" (S18 instances), "limits" (body, connection and grammar limits, demo, log level)."""
        d = ServerLimits()
        if "listen" in groups:
            p.add_argument("--host", default="127.0.0.1", help="interface to bind (default: loopback only)")
            p.add_argument("--port", type=int, default=8000)
        if "api" in groups:
            _add_api_args(p, d)
        if "disagg" in groups:
            _add_disagg_args(p)
        if "limits" in groups:
            _add_limit_args(p, d)
        return p

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "ServerArgs":
        """The options of a command line parsed with every group of `add_cli_args`."""
        limits = ServerLimits(body_timeout=args.body_timeout, header_timeout=args.header_timeout,
                              keep_alive_timeout=args.keep_alive_timeout, max_connections=args.max_connections,
                              max_waiting=args.max_waiting, max_waiting_tokens=args.max_waiting_tokens,
                              max_tokens_per_request=args.max_tokens_per_request or None,
                              special_tokens_in_content=args.special_tokens_in_content,
                              tokenizer_process=not args.no_tokenizer_process,
                              allowed_hosts=list(args.allowed_hosts), allowed_origins=list(args.allowed_origins),
                              bind_host=args.host, stats_interval=args.stats_interval,
                              body_first_byte_timeout=args.body_first_byte_timeout,
                              max_uploads_per_client=args.max_uploads_per_client,
                              shutdown_timeout=args.shutdown_timeout)
        return cls(host=args.host, port=args.port, served_model_name=args.served_model_name,
                   prompt_cache_dir=args.prompt_cache_dir, api_key=args.api_key, max_body_bytes=args.max_body_bytes,
                   max_grammar_compile_s=args.max_grammar_compile_s, max_grammar_states=args.max_grammar_states,
                   with_demo=args.with_demo, log_level=args.log_level, prefill_instances=args.prefill_instances,
                   decode_instances=args.decode_instances,
                   prefill_tensor_parallel_size=args.prefill_tensor_parallel_size,
                   decode_tensor_parallel_size=args.decode_tensor_parallel_size, limits=limits)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _add_api_args(p: argparse.ArgumentParser, d: ServerLimits) -> None:
    p.add_argument("--served-model-name", default=None, help="model id clients send (default: the file name)")
    p.add_argument("--prompt-cache-dir", default=None, metavar="DIR",
                   help="S21: POST /prompt_cache/{save,restore,erase} keep prompt KV files in DIR (off without it)")
    p.add_argument("--api-key", default=os.environ.get("PYENGINE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every route but /health (default: $PYENGINE_API_KEY)")
    p.add_argument("--max-waiting", type=int, default=d.max_waiting,
                   help=f"sequences (n counts) that may wait for the engine; more get 429 (default {d.max_waiting})")
    p.add_argument("--max-waiting-tokens", type=int, default=None,
                   help="prompt tokens that may wait for the engine (default 16 x max-model-len)")
    p.add_argument("--max-tokens-per-request", type=int, default=d.max_tokens_per_request,
                   help=f"n x max_tokens one request may ask for; 0 = unlimited (default {d.max_tokens_per_request})")


def _add_disagg_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefill-instances", type=int, default=0,
                   help="S18: prefill engines (MPI ranks) computing prompts and shipping their KV blocks; with "
                        "--decode-instances: 1 + P x Tp + D x Td ranks, the router on rank 0, then each prefill "
                        "instance's Tp ranks, then each decode instance's Td (T: --tensor-parallel-size, or the "
                        "role's own below)")
    p.add_argument("--decode-instances", type=int, default=0,
                   help="S18: decode engines adopting the shipped KV blocks and streaming the rest")
    p.add_argument("--prefill-tensor-parallel-size", type=int, default=None,
                   help="S18: ranks of each prefill instance (default --tensor-parallel-size)")
    p.add_argument("--decode-tensor-parallel-size", type=int, default=None,
                   help="S18: ranks of each decode instance (default --tensor-parallel-size)")


def _add_limit_args(p: argparse.ArgumentParser, d: ServerLimits) -> None:
    p.add_argument("--max-body-bytes", type=int, default=MAX_BODY_BYTES, help="larger request bodies get 413")
    p.add_argument("--body-timeout", type=float, default=d.body_timeout,
                   help=f"seconds for a request body to arrive (408 otherwise; default {d.body_timeout:g})")
    p.add_argument("--header-timeout", type=float, default=d.header_timeout,
                   help=f"seconds for a connection to send its request headers (default {d.header_timeout:g})")
    p.add_argument("--keep-alive-timeout", type=float, default=d.keep_alive_timeout,
                   help=f"idle keep-alive connections are closed after this (default {d.keep_alive_timeout:g} s)")
    p.add_argument("--max-connections", type=int, default=d.max_connections,
                   help=f"connections served at once; requests beyond get 503 (default {d.max_connections})")
    p.add_argument("--body-first-byte-timeout", type=float, default=d.body_first_byte_timeout,
                   help=f"seconds for a request body's first byte to arrive (408 otherwise; default "
                        f"{d.body_first_byte_timeout:g})")
    p.add_argument("--max-uploads-per-client", type=int, default=d.max_uploads_per_client,
                   help=f"connections of one client address (IPv6: its /64) whose body is still arriving; one "
                        f"more gets 429 (default {d.max_uploads_per_client})")
    p.add_argument("--shutdown-timeout", type=float, default=d.shutdown_timeout,
                   help=f"on SIGTERM / Ctrl-C: seconds running requests may take to finish before their streams "
                        f"are ended with an error event (default {d.shutdown_timeout:g})")
    p.add_argument("--allowed-hosts", nargs="+", default=[], metavar="NAME",
                   help="extra Host names accepted ('*': any); on loopback only loopback names are by default")
    p.add_argument("--allowed-origins", nargs="+", default=[], metavar="ORIGIN",
                   help="browser origins allowed cross-origin access (CORS; default none)")
    p.add_argument("--max-grammar-compile-s", type=float, default=DEFAULT_COMPILE_S,
                   help="S15: seconds a request's grammar (JSON schema, regex, GBNF, choice) may take to compile; "
                        f"slower ones get 400 (default {DEFAULT_COMPILE_S:g})")
    p.add_argument("--max-grammar-states", type=int, default=DEFAULT_MAX_STATES,
                   help="S15: automaton states a request's grammar may need; larger ones get 400 "
                        f"(default {DEFAULT_MAX_STATES})")
    p.add_argument("--special-tokens-in-content", action="store_true",
                   help="read control-token strings inside chat messages as control tokens (lets any client "
                        "forge turns; off by default)")
    p.add_argument("--no-tokenizer-process", action="store_true",
                   help="tokenize prompts in the server's process (default: a worker process, so a long prompt "
                        "cannot slow the engine)")
    p.add_argument("--stats-interval", type=float, default=d.stats_interval,
                   help=f"seconds between stats log lines; 0 = none (default {d.stats_interval:g})")
    p.add_argument("--with-demo", action="store_true", help="also serve the web demo at / (same process)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
