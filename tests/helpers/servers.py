"""A `swaserve serve` process on a free loopback port, started and stopped as a user
would (the app in process is conftest.py's inprocess_served)."""

from __future__ import annotations

import os


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(*args: str, timeout: float = 300):
    """`swaserve serve ARGS` on a free loopback port: (base URL, process), once /health
    answers. Its stdout and stderr go to the process's pipe (read it after it exits)."""
    import subprocess
    import sys
    import time

    import httpx

    port = free_port()
    env = {**os.environ, "SWASERVE_NO_PROGRESS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "swaserve", "serve", "--port", str(port),
                             *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return base, proc
        except httpx.HTTPError:
            time.sleep(0.2)
        if proc.poll() is not None:
            raise RuntimeError(proc.stdout.read())
    proc.kill()
    raise RuntimeError(f"the server did not answer /health within {timeout} s")


def stop_server(proc, timeout: float = 60) -> str:
    """SIGTERM, then its exit status must be 0; returns what it printed."""
    import signal

    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out
    return out
