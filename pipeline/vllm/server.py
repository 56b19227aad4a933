"""A vLLM OpenAI server with a life cycle: started on a free port, waited for, logged, always stopped.

    with Server(model_dir, ["--dtype", "bfloat16"], log=run_dir / "vllm/logs/x.log") as srv:
        srv.url                  # http://127.0.0.1:<port>; stopped after the block, whatever happened

It runs in a process group of its own (stopping it stops its engine cores), dies with specq, and a
SIGTERM to specq unwinds the `with` block. A failed start is one line; a port taken meanwhile is retried.
"""
from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from pipeline.core.stage import StageError
from pipeline.vllm.env import vllm_python

HOST = "127.0.0.1"
STOP_GRACE_S = 20.0
PORT_RETRIES = 3
# Markers of a failed bind in the server's log (uvicorn / asyncio wording).
PORT_TAKEN = ("address already in use", "errno 98")


class EngineStartError(StageError):
    """vLLM did not come up (it exited, timed out, or found no port); the message is one line."""


def free_port() -> int:
    """A port nobody listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the child before exec: a new session, and SIGTERM when specq's process dies (Linux)."""
    os.setsid()
    if sys.platform.startswith("linux"):
        with contextlib.suppress(Exception):
            import ctypes

            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def last_error_line(log: Path, limit: int = 240) -> str:
    """The last "...Error: ..." line of a server log, else the last mentioning an error, else the last."""
    try:
        lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "(no log)"
    lines = [ln for ln in lines if not ln.startswith(("For further information", "#"))]
    for pattern in (re.compile(r"(Error|error)[,:] "), re.compile(r"error|exception|failed", re.I)):
        for ln in reversed(lines):
            if pattern.search(ln) and "ulimit" not in ln:
                return ln[-limit:]
    return lines[-1][-limit:] if lines else "(empty log)"


class Server:
    """One vLLM server process. `args` are the server's own flags after --model; `env` is added to
    the environment (VLLM_CPU_KVCACHE_SPACE, ...)."""

    def __init__(self, model: str | Path, args: list[str], log: Path, env: dict[str, str] | None = None,
                 startup_timeout_s: float = 600.0, python: Path | None = None, name: str = "vllm",
                 port_chooser=free_port):
        self.model, self.args, self.log = str(model), list(args), Path(log)
        self.env = dict(env or {})
        self.startup_timeout_s = startup_timeout_s
        self.python = python or vllm_python()
        self.name = name
        self.port_chooser = port_chooser
        self.port: int | None = None
        self.proc: subprocess.Popen | None = None
        self.start_s: float | None = None  # seconds from launch to ready
        self._old_sigterm = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def __enter__(self) -> "Server":
        self._trap_sigterm()
        try:
            self.start()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.stop()
        finally:
            self._restore_sigterm()

    def start(self) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        for attempt in range(PORT_RETRIES):
            self.port = self.port_chooser()
            cmd = [str(self.python), "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
                   "--host", HOST, "--port", str(self.port), *self.args]
            t0 = time.perf_counter()
            with open(self.log, "a") as fh:
                fh.write(f"# specq: starting {self.name} on port {self.port}: {' '.join(cmd)}\n")
                fh.flush()
                self.proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL, env={**os.environ, **self.env},
                                             preexec_fn=_die_with_parent)
            why = self._wait_ready()
            if why is None:
                self.start_s = time.perf_counter() - t0
                return
            self.stop()
            tail = last_error_line(self.log).lower()
            if why == "exited" and any(m in tail for m in PORT_TAKEN) and attempt + 1 < PORT_RETRIES:
                continue  # someone took the port between choosing and binding: another one
            if why == "timeout":
                raise EngineStartError(f"{self.name}: vLLM was not ready after {self.startup_timeout_s:.0f} s "
                                 f"(log: {self.log})")
            raise EngineStartError(f"{self.name}: vLLM exited while starting: {last_error_line(self.log)} (log: {self.log})")
        raise EngineStartError(f"{self.name}: vLLM could not bind a port in {PORT_RETRIES} tries (log: {self.log})")

    def _wait_ready(self) -> str | None:
        """None once /health answers 200; "exited" if the process ended; "timeout"."""
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return "exited"
            if self.healthy():
                return None
            time.sleep(0.5)
        return "timeout"

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        """SIGTERM to the server's process group, SIGKILL after STOP_GRACE_S; idempotent."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=STOP_GRACE_S)
        # The group may outlive its leader (engine-core children): make sure it is gone.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)

    def _trap_sigterm(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return

        def on_term(signum, frame):
            raise KeyboardInterrupt(f"signal {signum}")
        self._old_sigterm = signal.signal(signal.SIGTERM, on_term)

    def _restore_sigterm(self) -> None:
        if self._old_sigterm is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._old_sigterm)
            self._old_sigterm = None

