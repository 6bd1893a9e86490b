"""S19 The server's errors, in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}`` with its status.

The lowest layer of the server (the order, each importing only those before it, is in docs/architecture.md):

    errors -> request parsing (constraints, parsing) -> response shaping (shaping, streaming)
           -> serving (engine_loop, serving, responses, the worker processes) -> HTTP (guard, http_server, app)

Every refusal the server makes is an `APIError` built here, so the statuses and codes a client can meet are in one
place. Messages name the parameter at fault and never the server's internals. Plain Python (no starlette): an
`APIError` crosses from the tokenizer worker process (it pickles by value).
"""
from __future__ import annotations


class APIError(Exception):
    """An error the client caused (or a server failure), already in OpenAI's shape."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)

    def __reduce__(self):   # it crosses from the tokenizer process (tokenizer_process.py)
        return APIError, (self.status, self.message, self.type, self.param, self.code, self.headers)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


CLOSE = {"connection": "close"}    # the connection's state is unknown after this error: the client opens a new one


# --- 400: the request is wrong ----------------------------------------------------------------------
def bad_param(param: str, message: str) -> APIError:
    return APIError(400, message, param=param, code="invalid_value")


def int_field(body: dict, name: str, lo: int, hi: int | None = None) -> int | None:
    """A body's integer field (None when absent; 3.0 counts as 3), or a 400 naming it."""
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if not isinstance(v, int) or isinstance(v, bool):
        raise bad_param(name, f"{name} must be an integer, got {v!r}")
    if v < lo or (hi is not None and v > hi):
        rng = f"at least {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise bad_param(name, f"{name} must be {rng}, got {v}")
    return v


def str_list(body: dict, name: str, most: int, noun: str = "strings") -> list[str] | None:
    """A body's field that is a string or a list of strings (None when absent), at most ``most`` of them, or a
    400 naming it."""
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise bad_param(name, f"{name} must be a string or a list of strings")
    if len(v) > most:
        raise bad_param(name, f"{name} may hold at most {most} {noun}, got {len(v)}")
    return v


def missing_param(param: str, message: str | None = None) -> APIError:
    return APIError(400, message or f"{param} is required", param=param, code="missing_required_parameter")


def param_named_in(message: str, candidates) -> str | None:
    """A ValueError's message (SamplingParams', the engine's) starts with the parameter's name; find it for the
    error body."""
    for name in sorted(candidates, key=len, reverse=True):
        if message.startswith(name) or f" {name}" in message:
            return name
    return None


# --- 404, 408, 413, 415: what is asked for, or how it arrives ------------------------------------------------
def model_not_found(model: str, served: str) -> APIError:
    return APIError(404, f"The model '{model}' does not exist; this server serves '{served}'.", param="model",
                    code="model_not_found")


def route_not_found(method: str, path: str, routes, demo: bool) -> dict:
    """The body of a 404 for a path that is no route: it lists the routes (the app's one route table)."""
    message = (f"{method} {path} is not a route of this server; it serves " + ", ".join(routes)
               + (" and the web demo under /" if demo else "") + ".")
    return error_body(message, "not_found", None, "route_not_found")


def body_timeout(seconds: float) -> APIError:
    return APIError(408, f"The request body did not arrive within {seconds:g} s.", code="request_timeout",
                    headers=CLOSE)


def too_large(limit: int) -> APIError:
    return APIError(413, f"Request body exceeds the limit of {limit} bytes.", code="request_too_large",
                    headers=CLOSE)


def not_json(media: str) -> APIError:
    return APIError(415, f"Content-Type must be application/json, got {media or 'none'!r}.",
                    code="unsupported_media_type")


# --- 429, 500, 503: the server cannot take it now ----------------------------------------------------------
def overloaded(why: str) -> APIError:
    return APIError(429, f"The server is overloaded: {why}. Retry later.", type="rate_limit_exceeded",
                    code="engine_overloaded", headers={"retry-after": "1"})


def engine_failed() -> APIError:
    # The exception is in the server's log; its text may hold internals, so the client gets none of it.
    return APIError(500, "The engine failed while running this request; the server's log has the details.",
                    type="server_error", code="engine_error", headers=CLOSE)


def engine_unavailable(why) -> APIError:
    return APIError(503, f"engine unavailable: {why}", type="server_error", code="engine_unavailable")


def shutting_down() -> APIError:
    return APIError(503, "The server is shutting down; retry on another instance.", type="server_error",
                    code="shutting_down", headers={**CLOSE, "retry-after": "1"})


def aborted(reason: str) -> APIError:
    return APIError(503, f"request aborted: {reason}", type="server_error", code="aborted")
