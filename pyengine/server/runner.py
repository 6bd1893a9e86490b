"""Run an ASGI app under uvicorn in a background thread (tests, `pyengine bench serve`).

The server binds before `start()` returns, on a free port when port=0; `url` is then ready to use.
"""
from __future__ import annotations

import threading
import time


class ServerThread:
    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        import uvicorn  # lazy: only servers pay for it

        config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on", http="h11",
                                ws="none", timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
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
