"""Files other processes poll (status, ready, control and infra files), written whole."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def write_json_whole(path: Path, data: Any, indent: int | None = None) -> None:
    """Write ``data`` as JSON to ``path`` through a temporary file and a rename: a reader
    sees the old file or the new one, never a truncated one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=indent))
    os.replace(tmp, path)
