"""The console every CLI command prints its tables and lines on."""

from __future__ import annotations

import sys

from rich.console import Console

PIPED_WIDTH = 1000
"""Columns a command's output may take when it is not a terminal: tables and lines keep
their own width, so no value is cut or wrapped for the next command in a pipe."""


def cli_console() -> Console:
    """A terminal's own width; piped (``dynamo status | grep ...``), ``PIPED_WIDTH``
    instead of the 80 columns rich would assume."""
    return Console() if sys.stdout.isatty() else Console(width=PIPED_WIDTH)
