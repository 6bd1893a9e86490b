"""Run an ASGI app under uvicorn: `uvicorn_server` (the limits of `ServerLimits` applied, used by
`pyengine serve` and `pyengine web`), `bind_socket` (a taken port is found before the model loads) and
`ServerThread` (a background thread, for tests and `pyengine bench serve`).

The server binds before `ServerThread.start()` returns, on a free port when port=0; `url` is then ready.
"""
from __future__ import annotations

import errno
import socket
import threading
import time


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening socket on host:port, or OSError with a readable message (port taken, bad address)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        why = ("the port is already in use (another server? pick another with --port)"
               if exc.errno == errno.EADDRINUSE else exc.strerror)
        raise OSError(f"cannot listen on {host}:{port}: {why}") from None
    sock.set_inheritable(True)
    return sock


def _guarded_protocol(header_timeout: float):
    """uvicorn's h11 protocol, plus a deadline for each request's headers: uvicorn closes idle keep-alive
    connections but waits forever for a connection that sends nothing, or a header a byte a minute."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class GuardedH11Protocol(H11Protocol):
        _header_timer = None

        def _arm(self) -> None:
            self._disarm()
            self._header_timer = self.loop.call_later(header_timeout, self._header_deadline)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _header_deadline(self) -> None:
            if (self.cycle is None or self.cycle.response_complete) and not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.cycle is not None and not self.cycle.response_complete:
                self._disarm()            # a request is under way: its body has its own timeout

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

    return GuardedH11Protocol


def uvicorn_server(app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning", limits=None):
    """A `uvicorn.Server` for `app` with the connection limits of `limits` (a ServerLimits; default: the
    app's own, `app.state.limits`, else the defaults)."""
    import uvicorn  # lazy: only servers pay for it

    from pyengine.server.guard import ServerLimits

    limits = limits or getattr(getattr(app, "state", None), "limits", None) or ServerLimits()
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                            http=_guarded_protocol(limits.header_timeout), ws="none",
                            timeout_graceful_shutdown=5, timeout_keep_alive=limits.keep_alive_timeout,
                            # uvicorn answers 503 once connections >= the limit, the asking one included
                            limit_concurrency=limits.max_connections + 1)
    return uvicorn.Server(config)


class ServerThread:
    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning", limits=None):
        self.server = uvicorn_server(app, host, port, log_level, limits)
        self.host = host
        self.port = port
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> "ServerThread":
        self._thread = threading.Thread(target=self.server.run, name="pyengine-uvicorn", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive():
                raise RuntimeError("uvicorn exited during startup (port in use?)")
            if time.monotonic() > deadline:
                raise TimeoutError("uvicorn did not start in time")
            time.sleep(0.01)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
