"""Where local state lives: per-run directories, the run registry, dev infrastructure."""

from __future__ import annotations

import os
import stat
import tempfile
import time
from pathlib import Path

import click


class UnsafeStateDir(click.ClickException):
    """The default state directory exists but another user could tamper with it (the CLI
    prints the message and exits 1)."""


def state_root(explicit: str | None) -> Path:
    """Root for local state: ``--state-dir`` / SPLITSERVE_HOME, else a per-user temp dir.

    The default lives in the shared temp directory, where another user could create it
    first and then plant registry entries that point this user's CLI at their server
    (with this user's control token).  So it is created 0700 and refused unless this user
    owns it and nobody else can write to it.
    """
    if explicit:
        return Path(explicit)
    root = Path(tempfile.gettempdir()) / f"splitserve-{os.getuid()}"
    root.mkdir(mode=0o700, exist_ok=True)
    st = os.lstat(root)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise UnsafeStateDir(f"{root} is not a directory owned by this user and writable "
                             "only by it; remove it or pass --state-dir")
    return root


def new_run_dir(root: Path) -> Path:
    """A fresh directory for one `dynamo serve` run (data of embedded servers, logs)."""
    runs = root / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=time.strftime("%Y%m%d-%H%M%S-"), dir=runs))


def registry_dir(root: Path) -> Path:
    """One JSON file per live `dynamo serve` supervisor, named by its pid."""
    return root / "supervisors"


def dev_infra_dir(root: Path) -> Path:
    """Where `dynamo infra up` keeps its servers' data and state file."""
    return root / "dev-infra"
