"""Where local state lives: per-run directories, the run registry, dev infrastructure."""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path


def state_root(explicit: str | None) -> Path:
    """Root for local state: ``--state-dir`` / SPLITSERVE_HOME, else a per-user temp dir."""
    if explicit:
        return Path(explicit)
    return Path(tempfile.gettempdir()) / f"splitserve-{os.getuid()}"


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
