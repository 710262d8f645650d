"""Logging a repeating failure once per kind: pollers and reporters run several times a
second, and a peer that is down would otherwise flood the log with the same line."""

from __future__ import annotations

import logging


class OncePerKind:
    """``self(exc)`` logs ``message % kind`` at warning the first time each kind of
    failure (its type and text, cut to 200 characters) is seen."""

    def __init__(self, log: logging.Logger, message: str) -> None:
        self.log, self.message = log, message
        self.seen: set[str] = set()

    def __call__(self, exc: BaseException) -> None:
        kind = f"{type(exc).__name__}: {exc}"[:200]
        if kind not in self.seen:
            self.seen.add(kind)
            self.log.warning(self.message, kind)
