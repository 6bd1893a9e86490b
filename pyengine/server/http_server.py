"""Run an ASGI app under uvicorn: `uvicorn_server` (the limits of `ServerLimits` applied, used by
`pyengine serve` and `pyengine web`), `bind_socket` (a taken port is found before the model loads) and
`ServerThread` (a background thread, for tests and `pyengine bench serve`).

The server binds before `ServerThread.start()` returns, on a free port when port=0; `url` is then ready.
What uvicorn lacks is added by plain classes: `ConnectionGuard` (one per server: header and first-byte deadlines,
per-client upload accounting in `Uploads`; uvicorn's protocol factory) builds a `GuardedH11Protocol` per
connection, and `GracefulServer` drains on SIGTERM / SIGINT.

HTTP layer of the server (errors -> request parsing -> response shaping -> serving -> app): it imports errors
and limits; the app it runs is any ASGI app (`Drain` is what it asks of create_app's state).
"""
from __future__ import annotations

import asyncio
import errno
import ipaddress
import json
import logging
import os
import socket
import threading
import time
from typing import Protocol

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from pyengine.server.errors import error_body
from pyengine.server.limits import ServerLimits

log = logging.getLogger("pyengine.server")


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


def client_key(host: str | None) -> str:
    """The address a per-client cap counts by: the IPv4 address, or the /64 of an IPv6 one (one subscriber
    commonly holds a whole /64, so counting single IPv6 addresses would not bound anyone)."""
    if not host:
        return "?"
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return host
    if ip.version == 6:
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.ip_network(f"{ip}/64", strict=False))
    return str(ip)


def raw_error(status: int, reason: str, message: str, code: str, retry_after: int | None = None) -> bytes:
    """A complete HTTP/1.1 error response (OpenAI-shaped body) that closes the connection, written by the
    protocol itself (before or instead of the app)."""
    body = json.dumps(error_body(message, "invalid_request_error", None, code)).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            + (f"retry-after: {retry_after}\r\n" if retry_after is not None else "") + "connection: close\r\n\r\n")
    return head.encode() + body


class Uploads:
    """The connections of one server whose request body is still arriving, by client address
    (`client_key`); shared by the server's protocol instances (all on one event loop)."""

    def __init__(self, per_client: int):
        self.per_client = per_client
        self.by_client: dict[str, set] = {}

    def add(self, key: str, conn) -> bool:
        """Count `conn` as uploading for `key`; False (and not counted) when `key` is at its cap."""
        held = self.by_client.setdefault(key, set())
        if conn not in held and len(held) >= self.per_client:
            return False
        held.add(conn)
        return True

    def discard(self, key: str, conn) -> None:
        held = self.by_client.get(key)
        if held is not None:
            held.discard(conn)
            if not held:
                del self.by_client[key]

    def count(self, key: str) -> int:
        return len(self.by_client.get(key, ()))


class ConnectionGuard:
    """The deadlines and upload accounting one server's connections share (from its `ServerLimits`), and the
    protocol factory uvicorn is given (``Config(http=guard)``: it calls it once per connection).

    uvicorn's h11 protocol lacks:
    - a deadline for each request's headers, `header_timeout` (uvicorn closes idle keep-alive connections
      but waits forever for a connection that sends nothing, or a header a byte a minute);
    - a deadline for a request body's first byte, `body_first_byte_timeout` (408), apart from the app's
      whole-body timeout, so a stalled upload does not hold its connection for the whole body timeout;
    - a per-client bound on uploads: one client address (an IPv6 /64) may have at most
      `max_uploads_per_client` connections whose body is still arriving `upload_grace` s after its headers (at
      once when half the connection cap is taken); one more is answered 429 and closed. Stalled uploads from one
      address then cannot fill the server's connection cap and starve /health and every other client, while a
      burst of ordinary requests (whose bodies follow their headers within milliseconds) is not counted at all
      on a server that is not crowded."""

    def __init__(self, limits: ServerLimits):
        self.header_timeout = limits.header_timeout
        self.first_byte_timeout = limits.body_first_byte_timeout
        self.upload_grace = limits.upload_grace
        self.uploads = Uploads(max(1, limits.max_uploads_per_client))
        self.pressure = max(1, limits.max_connections // 2)    # open connections from which uploads get no grace

    def __call__(self, **kw) -> "GuardedH11Protocol":
        return GuardedH11Protocol(self, **kw)


class GuardedH11Protocol(H11Protocol):
    """One connection under a `ConnectionGuard`: uvicorn's h11 protocol plus the guard's deadlines and upload
    accounting (the guard's docstring says which and why)."""

    def __init__(self, guard: ConnectionGuard, **kw):
        super().__init__(**kw)
        self.guard = guard
        self._header_timer = None
        self._body_timer = None
        self._grace_timer = None
        self._uploading = None          # the cycle whose body is arriving (counted in `uploads` after the grace)

    def _arm(self) -> None:
        self._disarm()
        self._header_timer = self.loop.call_later(self.guard.header_timeout, self._header_deadline)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_deadline(self) -> None:
        if (self.cycle is None or self.cycle.response_complete) and not self.transport.is_closing():
            self.transport.close()

    @property
    def _key(self) -> str:
        return client_key(self.client[0] if self.client else None)

    def _refuse(self, payload: bytes) -> None:
        """Answer (unless the app already started to) and close; the app's body read then sees a disconnect."""
        self._end_upload()
        if self.transport.is_closing():
            return
        cycle = self.cycle
        if cycle is not None and not cycle.response_started:
            self.transport.write(payload)
        if cycle is not None:             # the app's reads see a disconnect, its writes are dropped
            cycle.disconnected = True
            cycle.message_event.set()
        self.transport.close()

    def _first_byte_deadline(self) -> None:
        self._body_timer = None
        if self._uploading is not None and self._uploading is self.cycle:
            self._refuse(raw_error(408, "Request Timeout", f"The request body did not start within "
                                   f"{self.guard.first_byte_timeout:g} s.", "request_timeout"))

    def _end_upload(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        if self._grace_timer is not None:
            self._grace_timer.cancel()
            self._grace_timer = None
        if self._uploading is not None:
            self._uploading = None
            self.guard.uploads.discard(self._key, self)

    def _track_upload(self) -> None:
        receiving = (self.cycle is not None and not self.cycle.response_complete
                     and self.conn.their_state is h11.SEND_BODY)
        if not receiving:
            self._end_upload()
            return
        if self._uploading is self.cycle:             # more of a body already counted
            if self._body_timer is not None:
                self._body_timer.cancel()
                self._body_timer = None
            return
        self._end_upload()                            # a new request's body begins
        self._uploading = self.cycle
        guard = self.guard
        if not self.cycle.body:                       # headers only so far: the body's first byte is due
            self._body_timer = self.loop.call_later(guard.first_byte_timeout, self._first_byte_deadline)
        if guard.uploads.count(self._key) >= guard.uploads.per_client or len(self.connections) >= guard.pressure:
            self._count_upload()     # its stalled ones fill its share, or the server is half full: no grace
        else:
            self._grace_timer = self.loop.call_later(guard.upload_grace, self._count_upload)

    def _count_upload(self) -> None:
        """The body is still arriving after the grace: it counts against its client's cap."""
        self._grace_timer = None
        if self._uploading is None or self._uploading is not self.cycle or self.transport.is_closing():
            return
        uploads = self.guard.uploads
        if not uploads.add(self._key, self):
            self._refuse(raw_error(429, "Too Many Requests", f"This client already has "
                                   f"{uploads.per_client} requests whose body is still arriving "
                                   f"(--max-uploads-per-client); finish one first.", "too_many_uploads",
                                   retry_after=1))

    def refuse_upload(self) -> None:
        """A graceful stop: a body still arriving will not be served."""
        if self._uploading is not None and self._uploading is self.cycle:
            self._refuse(raw_error(503, "Service Unavailable", "The server is shutting down.", "shutting_down"))

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.cycle is not None and not self.cycle.response_complete:
            self._disarm()            # a request is under way: its body has its own deadlines
        if not self.transport.is_closing():
            self._track_upload()

    def on_response_complete(self) -> None:
        self._end_upload()
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm()

    def connection_lost(self, exc) -> None:
        self._disarm()
        self._end_upload()
        super().connection_lost(exc)


SHUTDOWN_MARGIN_S = 5.0    # after the shutdown timeout: time for the ended streams' last events to be sent


class Drain(Protocol):
    """What a graceful stop asks of an app (create_app's ServerState): refuse new requests, then end the
    running ones (each open stream gets an error event and [DONE])."""

    def stop_admissions(self) -> None: ...

    def end_streams(self, reason: str) -> int: ...


class GracefulServer(uvicorn.Server):
    """A `uvicorn.Server` that stops gracefully: admissions stopped, uploads still arriving refused with 503,
    running requests given `grace` s, then `drain.end_streams` ends the rest."""

    def __init__(self, config, drain: Drain | None, grace: float):
        super().__init__(config)
        self.drain, self.grace = drain, grace

    async def shutdown(self, sockets=None) -> None:
        busy = sum(1 for c in self.server_state.connections if c.cycle is not None
                   and not c.cycle.response_complete)
        log.info("shutting down: new requests are refused; %d running may take %g s to finish "
                 "(--shutdown-timeout)", busy, self.grace)
        if self.drain is not None:
            self.drain.stop_admissions()
        for conn in list(self.server_state.connections):
            if isinstance(conn, GuardedH11Protocol):
                conn.refuse_upload()
        timer = asyncio.get_running_loop().call_later(self.grace, self._end_streams)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()

    def _end_streams(self) -> None:
        if self.drain is not None:
            n = self.drain.end_streams(f"server shutting down (--shutdown-timeout {self.grace:g} s passed)")
            if n:
                log.warning("shutdown timeout: ended %d running request(s) with an error", n)


def uvicorn_server(app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning", limits=None,
                   drain: Drain | None = None) -> GracefulServer:
    """A `uvicorn.Server` for `app` with the connection limits of `limits` (a ServerLimits; default: the
    app's own, `app.state.limits`, else the defaults), stopping gracefully on SIGTERM / SIGINT (or
    `should_exit`): no new connections or requests, uploads still arriving refused with 503, running
    requests given `limits.shutdown_timeout` s to finish, then `drain.end_streams` (default: the app's own,
    `app.state.drain`) ends the rest, so every open stream ends with an error event and [DONE] instead of
    being cut."""
    app_state = getattr(app, "state", None)
    limits = limits or getattr(app_state, "limits", None) or ServerLimits()
    grace = limits.shutdown_timeout
    # a rank of an MPI job writes to a pty Open MPI gives it, even when the job's log is a file (launch.relaunch)
    colors = False if os.environ.get("PYENGINE_LOG_COLOR") == "0" else None
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                            http=ConnectionGuard(limits), use_colors=colors,
                            ws="none", timeout_graceful_shutdown=grace + SHUTDOWN_MARGIN_S,
                            timeout_keep_alive=limits.keep_alive_timeout,
                            # uvicorn answers 503 once connections >= the limit, the asking one included
                            limit_concurrency=limits.max_connections + 1)
    return GracefulServer(config, drain or getattr(app_state, "drain", None), grace)


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
