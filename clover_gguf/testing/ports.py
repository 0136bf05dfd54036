"""A free TCP port on loopback, and stopping a server process, for the servers the tests, benches and demo start (one
home: they all had a copy)."""

from __future__ import annotations

import socket
import subprocess


def free_port() -> int:
    """A port nothing listens on now (the OS's pick; another program may take it before the caller binds it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop(proc: subprocess.Popen, timeout: float = 15) -> None:
    """Stop a server process: SIGTERM, then SIGKILL if it has not exited within `timeout` seconds; reaped either way."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
