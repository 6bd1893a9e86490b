"""S17/S18: a rank's link to the launcher that started its MPI job (parallel/launch.py `relaunch`).

The launcher listens on a control socket (Linux abstract namespace: no file), named in $PYENGINE_MPI_CONTROL. Each
rank connects once it starts (`join_launcher`) and says ``rank N``; ``exit`` when it ends normally (`say_exit`, at
interpreter exit), ``abort`` before a deliberate MPI_Abort (`say_abort`: the ranks it ends did not die on their
own). A connection that closes without either is a rank that died. The rank watches the same connection: its end
means the launcher is gone (kill -9), and the rank leaves at once instead of serving on, re-parented to PID 1.
Without the variable (mpiexec run by hand, across hosts) every function here does nothing.
"""
from __future__ import annotations

import atexit
import os
import socket
import threading

CONTROL_ENV = "PYENGINE_MPI_CONTROL"
_CONTROL: dict = {}


def join_launcher() -> None:
    """In a rank started by ``relaunch``: report to the launcher, and end this process at once when the
    launcher is gone (kill -9 of it, or of its terminal): a rank re-parented to PID 1 would otherwise keep
    serving the port. Without a launcher (mpiexec run by hand) it does nothing."""
    name = os.environ.get(CONTROL_ENV)
    if not name or "sock" in _CONTROL:
        return
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMI_RANK", "0")))
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect("\0" + name.lstrip("@"))
        sock.sendall(f"rank {rank}\n".encode())
    except OSError:                      # the launcher is already gone
        os._exit(1)
    _CONTROL["sock"] = sock

    def watch():
        while True:
            try:
                if not sock.recv(64):
                    break
            except OSError:
                break
        if not _CONTROL.get("leaving"):
            os._exit(1)                  # the launcher died: leave now (no finalize: the job is over)
    threading.Thread(target=watch, name="pyengine-launcher-watch", daemon=True).start()
    atexit.register(say_exit)


def say_exit() -> None:
    """Tell the launcher this rank ends normally (idempotent; no launcher: nothing)."""
    _say(b"exit\n")


def say_abort() -> None:
    """Before a deliberate MPI_Abort: the ranks it ends are not failures of their own."""
    _say(b"abort\n")


def _say(word: bytes) -> None:
    """The rank's last word to the launcher: only one is said."""
    sock = _CONTROL.get("sock")
    if sock is None or _CONTROL.get("leaving"):
        return
    _CONTROL["leaving"] = True
    try:
        sock.sendall(word)
    except OSError:
        pass
