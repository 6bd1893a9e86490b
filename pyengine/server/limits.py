"""S19 The operator's limits of one server, and the loopback test: plain data, no starlette, so the CLI can
describe them (`pyengine serve --help`) before the server extras are installed. guard.py re-exports them."""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field


@dataclass
class ServerLimits:
    """Operator limits of one server (`pyengine serve` options of the same names)."""
    body_timeout: float = 30.0          # seconds for a request body to arrive in full (408 otherwise)
    header_timeout: float = 10.0        # seconds for a connection to send a request's headers
    keep_alive_timeout: float = 5.0     # idle keep-alive connections are closed after this
    max_connections: int = 256          # open connections served at once; requests beyond get 503
    max_waiting: int = 64               # sequences (n counts) waiting for the engine; more get 429
    max_waiting_tokens: int | None = None   # prompt tokens waiting (None: 16 x max_model_len)
    max_tokens_per_request: int | None = 8192   # n x max_tokens of one request (None: unlimited)
    special_tokens_in_content: bool = False     # chat messages may contain control tokens (unsafe)
    tokenizer_process: bool = False     # parse prompts in a worker process (pyengine serve: on)
    allowed_hosts: list[str] = field(default_factory=list)
    allowed_origins: list[str] = field(default_factory=list)
    bind_host: str = "127.0.0.1"
    stats_interval: float = 10.0        # seconds between stats log lines (0: none)
    body_first_byte_timeout: float = 5.0    # seconds for a request body's first byte (408 otherwise)
    max_uploads_per_client: int = 8     # connections of one client address with a body still arriving; more: 429
    upload_grace: float = 0.5           # seconds a body may take before it counts as "still arriving" above
    shutdown_timeout: float = 30.0      # on SIGTERM / SIGINT: seconds running requests may take to finish


def is_loopback(host: str | None) -> bool:
    if host is None or host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
