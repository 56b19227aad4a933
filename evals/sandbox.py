"""Run untrusted generated code (HumanEval completions) in separate, limited processes.

    from evals.sandbox import Limits, run_python, run_many
    run_many(programs, Limits(seconds=10, memory_bytes=1 << 30), workers=2)

Never in the pipeline's own process. Each program runs in a fresh `python -I -S -B` started with
an empty environment in an empty temporary directory (evals/sandbox_child.py), and is contained
in layers, outermost first:
  * wall clock: the parent kills the child's whole process group after `seconds`;
  * network: a fresh network namespace with no interfaces (`unshare -n`) where the machine allows
    it (root, or a kernel that lets this user create one), else only the socket guard below;
    `isolation()` says which;
  * resource limits set in the child before the program runs, hard and soft: address space
    (RLIMIT_AS), CPU seconds, size of written files, open files, no core dumps;
  * processes: as root the child is started as `nobody` (setpriv); RLIMIT_NPROC = 0 then makes
    every fork fail, so `os.system`, `subprocess` and `posix.system` cannot start anything;
  * a Python-level guard on os/subprocess/socket/shutil calls (see sandbox_child.guard);
  * output goes to files capped by RLIMIT_FSIZE, so a program that prints without end cannot
    fill the pipeline's memory.
A program passes only if it returns normally (exit status 0 and the child's end marker).
"""
from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from evals import sandbox_child

CHILD = Path(sandbox_child.__file__).resolve()
# Bytes of the child's stderr kept in an outcome (the end of a traceback says what failed).
DETAIL_BYTES = 400


@dataclass(frozen=True)
class Limits:
    seconds: float = 10.0            # wall clock per program (CPU limit: seconds + 1)
    memory_bytes: int = 1 << 30      # address space of the child process
    file_bytes: int = 1 << 20        # largest file (and captured output) it may write
    open_files: int = 64


@dataclass
class Outcome:
    passed: bool
    status: str      # passed | failed (an exception, e.g. AssertionError) | timeout | killed | exited
    detail: str      # the last line of stderr, or why the process ended
    seconds: float


NOBODY = "65534"


def _works(cmd: list[str]) -> bool:
    try:
        return subprocess.run([*cmd, "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _world_readable(path: Path) -> bool:
    """Whether `nobody` can read the interpreter's standard library at `path`."""
    for p in [path, *path.parents]:
        if not p.stat().st_mode & 0o001:  # no x for others on a directory on the way
            return False
    return bool(path.stat().st_mode & 0o004)


@functools.lru_cache(maxsize=1)
def launcher() -> tuple[tuple[str, ...], dict]:
    """The command prefix that puts the child in its own network namespace and, as root, makes
    it nobody; and a description of what that gives (isolation())."""
    info = {"python": "-I -S -B, empty environment, empty working directory",
            "limits": "RLIMIT_AS, RLIMIT_CPU, RLIMIT_FSIZE, RLIMIT_NOFILE, RLIMIT_NPROC = 0"}
    net: tuple[str, ...] = ()
    for prefix in (("unshare", "-n"), ("unshare", "-r", "-n")):
        if _works(list(prefix)):
            net = prefix
            break
    info["network"] = f"own empty namespace ({' '.join(net)})" if net else "socket guard only"
    user: tuple[str, ...] = ()
    if os.getuid() == 0 and net != ("unshare", "-r", "-n"):
        # RLIMIT_NPROC does not bind root. setpriv (util-linux, like unshare) switches to nobody.
        user = ("setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups")
        stdlib = Path(sysconfig.get_paths()["stdlib"]).resolve()
        if not _world_readable(stdlib):
            # This interpreter lives where nobody cannot read it (e.g. under /root): keep only
            # the capability to read files, nothing else.
            user += ("--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search")
        if not _works(list(user)):
            user = ()
    if user:
        info["user"] = "nobody" + (" (may read any file: the interpreter is not world-readable)"
                                   if "--ambient-caps=+dac_read_search" in user else "")
    elif os.getuid() == 0 and net != ("unshare", "-r", "-n"):
        info["user"] = "root: RLIMIT_NPROC does not bind; only the Python guard stops new processes"
    else:
        info["user"] = "the pipeline's own user (not root: RLIMIT_NPROC binds)"
    return net + user, info


def isolation() -> dict:
    """What containment is in effect on this machine (recorded in the quality stage's meta)."""
    return dict(launcher()[1])


def run_python(program: str, limits: Limits = Limits()) -> Outcome:
    """Run `program` in a sandboxed child process; wait at most limits.seconds."""
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="specq-sandbox-") as tmp:
        out_path, err_path = Path(tmp) / "stdout", Path(tmp) / "stderr"
        work = Path(tmp) / "work"
        work.mkdir()
        cmd = [*launcher()[0], sys.executable, "-I", "-S", "-B", str(CHILD), json.dumps(asdict(limits))]
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=out, stderr=err, cwd=work,
                                    env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
                                    start_new_session=True)  # its own process group, killed as one
            try:
                proc.stdin.write(program.encode("utf-8", "replace"))
                proc.stdin.close()
            except BrokenPipeError:
                pass
            try:
                rc = proc.wait(timeout=limits.seconds)
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                return Outcome(False, "timeout", f"no result within {limits.seconds:g} s",
                               time.perf_counter() - start)
        stdout = _tail(out_path, len(sandbox_child.MARKER) + 1)
        stderr = _tail(err_path, DETAIL_BYTES)
    seconds = time.perf_counter() - start
    last = stderr.strip().splitlines()[-1] if stderr.strip() else ""
    if rc == 0 and stdout.endswith(sandbox_child.MARKER.decode()):
        return Outcome(True, "passed", "", seconds)
    if rc == 0:
        return Outcome(False, "exited", "the program ended before its tests finished", seconds)
    if rc < 0:
        name = signal.Signals(-rc).name if -rc in signal.Signals._value2member_map_ else str(-rc)
        status = "timeout" if -rc == signal.SIGXCPU else "killed"
        return Outcome(False, status, f"killed by {name}", seconds)
    return Outcome(False, "failed", last or f"exit status {rc}", seconds)


def run_many(programs: list[str], limits: Limits = Limits(), workers: int | None = None) -> list[Outcome]:
    """Run every program in its own sandboxed process, `workers` at a time; results in order.
    Threads only wait on the children, so the pipeline's process stays idle meanwhile."""
    workers = max(1, workers or os.cpu_count() or 1)
    if not programs:
        return []
    with ThreadPoolExecutor(max_workers=min(workers, len(programs))) as pool:
        return list(pool.map(lambda p: run_python(p, limits), programs))


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _tail(path: Path, n: int) -> str:
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(0, f.tell() - n))
        return f.read().decode("utf-8", "replace")
