"""A real ``memlens serve`` in a child process on 127.0.0.1, for the upload and load tests.

The server is started with ``--port 0`` and found from the URL it prints (so that line must
carry the real port). Its uploads land under the test's own temporary folder (``TMPDIR``), so
a test can see every file the server leaves behind.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import requests

from memlens_app.session import COOKIE

# Bounds for the helpers' waiting loops: far beyond what a healthy server needs, only there
# so that a broken one fails the test instead of hanging it (pytest-timeout is the real bound).
START_S = 90.0
SETTLE_S = 60.0


class ServeProcess:
    """``memlens serve --port 0 --no-samples ARGS`` with its output drained in the background."""

    def __init__(self, tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> None:
        self.tmp_path = tmp_path
        env = dict(os.environ, TMPDIR=str(tmp_path), **(env or {}))
        self.process = subprocess.Popen(
            [sys.executable, "-m", "memlens", "serve", "--port", "0", "--no-samples", *args],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        self.output: list[str] = []
        self._first_line = threading.Event()
        self._drainer = threading.Thread(target=self._drain, daemon=True)
        self._drainer.start()
        self.url = self._wait_until_serving()
        self.port = int(self.url.rsplit(":", 1)[1].rstrip("/"))

    def _drain(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.output.append(line)
            if "dashboard on http://" in line:
                self._first_line.set()
        self._first_line.set()

    def _wait_until_serving(self) -> str:
        if not self._first_line.wait(START_S):
            self.stop()
            raise AssertionError(f"memlens serve printed no URL:\n{self.text()}")
        lines = [line for line in self.output if "dashboard on http://" in line]
        if not lines:
            self.stop()
            raise AssertionError(f"memlens serve did not start:\n{self.text()}")
        url = lines[0].split("dashboard on ", 1)[1].split()[0].rstrip("/")
        assert requests.get(url + "/", timeout=30).status_code == 200
        return url

    def text(self) -> str:
        return "".join(self.output)

    def pid(self) -> int:
        return self.process.pid

    def stop(self, sig: int = signal.SIGTERM) -> int:
        """Send ``sig`` and wait for the exit (killing it if it ignores the signal)."""
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout=SETTLE_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
                raise AssertionError(f"memlens serve ignored signal {sig}:\n{self.text()}") from None
        self._drainer.join(SETTLE_S)  # the pipe ends with the process (and its workers)
        if self.process.stdout is not None and not self._drainer.is_alive():
            self.process.stdout.close()
        return int(self.process.returncode)

    def upload(self, path: Path, name: str | None = None, timeout: float = 300,
               cookies: Any = None) -> requests.Response:
        """POST ``path`` as an upload: from a new browser session, or the one ``cookies`` holds."""
        with open(path, "rb") as handle:
            return requests.post(f"{self.url}/upload", params={"name": name or path.name}, data=handle,
                                 cookies=cookies, timeout=timeout)

    def new_session(self) -> Any:
        """The cookies of a new browser session (its first page load)."""
        response = requests.get(self.url + "/", timeout=30)
        assert COOKIE in response.cookies, "the server issued no session cookie"
        return response.cookies


def client_session(client: Any) -> str:
    """The browser session a Flask test client is given on its first page load."""
    client.get("/")
    cookie = client.get_cookie(COOKIE)
    assert cookie is not None, "the server issued no session cookie"
    return str(cookie.value.rpartition(".")[0])


def upload_files(tmp_path: Path) -> list[Path]:
    """Every file under the servers' upload folders in ``tmp_path``."""
    return [p for folder in tmp_path.glob("memlens-upload-*") for p in folder.rglob("*") if p.is_file()]


def wait_for(condition, what: str) -> None:  # type: ignore[no-untyped-def]
    """Poll ``condition()`` until it holds (the server cleans up on its own threads)."""
    deadline = time.monotonic() + SETTLE_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"still waiting for: {what}")
        time.sleep(0.05)


def raw_request(port: int, headers: dict[str, str], path: str = "/upload?name=raw.pickle") -> socket.socket:
    """Open a connection and send a POST's request line and headers only."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=SETTLE_S)
    lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", *(f"{k}: {v}" for k, v in headers.items()), "", ""]
    sock.sendall("\r\n".join(lines).encode())
    return sock


def read_response(sock: socket.socket) -> tuple[int, bytes]:
    """Status code and raw bytes of the answer on ``sock`` (read until the server closes it)."""
    chunks = []
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    data = b"".join(chunks)
    if not data:
        return 0, b""
    return int(data.split(b" ", 2)[1]), data


def hash_bomb_pickle() -> bytes:
    """~0.5 KB: a 64-level DAG of tuples (each level holds the one below twice) used as a dict key.

    Hashing the key visits 2**64 tuples: the unpickler's SETITEM never returns. Written opcode
    by opcode, because building the dict in Python to dump it would hash the key here.
    """
    out = bytearray(b"\x80\x04")  # PROTO 4
    out += b")\x94"  # EMPTY_TUPLE, MEMOIZE -> memo 0
    for level in range(64):
        out += b"h" + bytes([level]) + b"h" + bytes([level]) + b"\x86\x94"  # BINGET x2, TUPLE2, MEMOIZE
    out += b"}\x94"  # EMPTY_DICT (memo 65)
    out += b"\x8c\x08segments\x94]\x94"  # "segments": []
    out += b"s"  # SETITEM
    out += b"h" + bytes([64]) + b"K\x01s"  # bomb: 1, SETITEM (hashes the bomb)
    out += b"."
    return bytes(out)


def reference_amplification_pickle(entries: int = 50_000, devices: int = 2_000) -> bytes:
    """~100 KB: one trace of ``entries`` references to one event, shared by ``devices`` devices.

    Pickled, each repeat is a 2-5 byte memo reference; read naively it is ``entries * devices``
    (10**8) events to parse.
    """
    import pickle

    frame = {"filename": "train.py", "line": 1, "name": "forward"}
    event = {"action": "alloc", "addr": 0x7F0000000000, "size": 512, "stream": 0, "frames": [frame]}
    trace = [event] * entries
    return pickle.dumps({"segments": [], "device_traces": [trace] * devices}, protocol=4)
