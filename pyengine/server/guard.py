"""S19 What stands between the network and the API: limits, Host check, CORS, auth, and 500s that close.

A server on 127.0.0.1 without a key is still reachable from every web page the user opens: a page can
POST to it (a "simple" cross-origin request needs no preflight when its body is text/plain), and a DNS
rebinding attack makes the browser send requests to 127.0.0.1 under the attacker's host name, after
which the page may read the answers. The defences, outermost first:

    ErrorGuard   an exception that escapes a handler becomes an OpenAI-shaped 500 that names no internals
                 and carries `Connection: close` (the connection's state is unknown; pooled clients then
                 open a new one instead of meeting a reset)
    HostGuard    on loopback, the Host header must be a loopback name, an IP literal or --allowed-hosts
    CORS         off unless --allowed-origins (starlette's CORSMiddleware)
    AuthGuard    with --api-key, every route but /health needs it (Bearer, or Basic with the key as the
                 password so a browser can open the demo: it asks once and resends it)

The API handlers themselves require `Content-Type: application/json` on POST bodies (415), which turns
the preflight-free text/plain POST into a request browsers must ask permission for. Connection-level
limits (body and header timeouts, idle keep-alive, a connection cap) are `ServerLimits` (limits.py, free of
starlette so the CLI can describe them without the extras), applied by `http_server.uvicorn_server`.
"""
from __future__ import annotations

import base64
import binascii
import hmac
import ipaddress
import logging

from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse

from pyengine.server.errors import error_body
from pyengine.server.limits import ServerLimits, is_loopback  # noqa: F401 (ServerLimits: re-exported)

log = logging.getLogger("pyengine.server")

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def host_name(header: str) -> str:
    """'Example.COM:8000' -> 'example.com'; '[::1]:8000' -> '::1'."""
    h = header.strip().lower()
    if h.startswith("["):
        return h[1:h.find("]")] if "]" in h else h
    return h.rsplit(":", 1)[0] if h.count(":") == 1 else h


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False


class HostPolicy:
    """Which Host headers a server accepts. Bound to loopback: loopback names, `*.localhost`, IP
    literals (a rebinding attack needs a DNS name the attacker controls) and `allowed`; bound elsewhere:
    anything, unless `allowed` is given. '*' in `allowed` turns the check off."""

    def __init__(self, bind_host: str | None, allowed=()):
        self.allowed = {a.strip().lower().rstrip(".") for a in allowed if a.strip()}
        self.enabled = "*" not in self.allowed and (is_loopback(bind_host) or bool(self.allowed))
        self.loopback = is_loopback(bind_host)

    def allows(self, header: str | None) -> bool:
        if not self.enabled or header is None:
            return True
        name = host_name(header).rstrip(".")
        if name in self.allowed:
            return True
        if self.loopback:
            return name in LOOPBACK_NAMES or name.endswith(".localhost") or _is_ip(name)
        return False


def key_matches(authorization: str, api_key: str) -> bool:
    """'Bearer KEY', or 'Basic base64(anyuser:KEY)' (what a browser sends after asking for a password)."""
    scheme, _, token = authorization.partition(" ")
    scheme, token = scheme.lower(), token.strip()
    if scheme == "basic":
        try:
            token = base64.b64decode(token, validate=True).decode("utf-8").partition(":")[2]
        except (binascii.Error, UnicodeDecodeError):
            return False
    elif scheme != "bearer":
        return False
    return hmac.compare_digest(token.encode("utf-8", "surrogateescape"), api_key.encode())


def error_json(status: int, message: str, type: str, code: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type, None, code), status_code=status, headers=headers)


def _header(scope, name: bytes) -> str | None:
    for k, v in scope.get("headers", ()):
        if k == name:
            return v.decode("latin-1")
    return None


class ErrorGuard:
    """Outermost app middleware: an unhandled exception answers 500 + Connection: close, text-free."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracked(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception:
            log.exception("unhandled error in %s %s", scope.get("method"), scope.get("path"))
            if started:      # mid-response: all that can be done is to end the connection
                raise
            await error_json(500, "The server had an error while processing your request; it is in the "
                                  "server's log.", "server_error", "internal_error",
                             headers={"connection": "close"})(scope, receive, send)


class HostGuard:
    def __init__(self, app, policy: HostPolicy):
        self.app, self.policy = app, policy

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and not self.policy.allows(_header(scope, b"host")):
            host = host_name(_header(scope, b"host") or "")
            return await error_json(400, f"Host header {host!r} is not accepted by this server (DNS rebinding "
                                         f"protection); start it with --allowed-hosts {host or 'NAME'} to "
                                         f"serve that name.", "invalid_request_error", "invalid_host",
                                    headers={"connection": "close"})(scope, receive, send)
        return await self.app(scope, receive, send)


class AuthGuard:
    """With an API key, every route but the exempt ones (/health) needs it."""

    def __init__(self, app, api_key: str | None, exempt=("/health",)):
        self.app, self.api_key, self.exempt = app, api_key, set(exempt)

    async def __call__(self, scope, receive, send):
        if (scope["type"] != "http" or self.api_key is None or scope.get("path") in self.exempt
                or key_matches(_header(scope, b"authorization") or "", self.api_key)):
            return await self.app(scope, receive, send)
        headers = {"www-authenticate": "Bearer"}
        if not scope.get("path", "").startswith("/v1/"):   # the demo's pages: let the browser ask
            headers["www-authenticate"] = 'Basic realm="pyengine", charset="UTF-8"'
        await error_json(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'.",
                         "invalid_request_error", "invalid_api_key", headers=headers)(scope, receive, send)


def middleware(limits: ServerLimits, api_key: str | None) -> list:
    """The starlette middleware list (outermost first) for `create_app`."""
    stack = [Middleware(ErrorGuard), Middleware(HostGuard, policy=HostPolicy(limits.bind_host, limits.allowed_hosts))]
    if limits.allowed_origins:
        stack.append(Middleware(CORSMiddleware, allow_origins=list(limits.allowed_origins),
                                allow_methods=["GET", "POST", "OPTIONS"],
                                allow_headers=["authorization", "content-type"], max_age=600))
    stack.append(Middleware(AuthGuard, api_key=api_key))
    return stack

