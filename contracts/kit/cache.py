"""Where derived, re-creatable files live (exported model directories)."""

from __future__ import annotations

from pathlib import Path


def cache_root() -> Path:
    """Per-user cache directory for this project (``~/.cache/splitserve``)."""
    return Path.home() / ".cache" / "splitserve"


def model_cache_dir(name: str) -> Path:
    """Directory for the exported, weight-less HF files of model ``name``."""
    return cache_root() / "models" / name
