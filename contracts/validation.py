"""Helpers that turn config problems into pydantic ``ValidationError``s with field paths.

Called by the config loaders of the router and of the disaggregated router.  Checks that
need more than one model (a plugin reference, a plugin's parameters validated against the
model its type names) run after pydantic's own pass; these helpers let those checks raise
the same exception type, with the full path (``schedulingProfiles.0.plugins.2.weight``),
so the CLI reports every config mistake the same way.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, get_args

from pydantic import ValidationError
from pydantic_core import InitErrorDetails, PydanticCustomError
from pydantic_core.core_schema import ErrorType

_BUILT_IN_TYPES = frozenset(get_args(ErrorType))

Loc = tuple[int | str, ...]


def issue(loc: Loc, message: str, value: Any) -> InitErrorDetails:
    """Build one error line at ``loc``; ``message`` is shown as is."""
    # Braces would be read as format placeholders by PydanticCustomError.
    safe = message.replace("{", "(").replace("}", ")")
    return InitErrorDetails(type=PydanticCustomError("config_error", safe), loc=loc, input=value)


def rebased(error: ValidationError, prefix: Loc) -> list[InitErrorDetails]:
    """Return ``error``'s lines with ``prefix`` put in front of each location.

    Used when a nested part of a file (a plugin's ``parameters``) is validated on its own.
    """
    lines: list[InitErrorDetails] = []
    for line in error.errors(include_url=False):
        loc = prefix + tuple(line["loc"])
        if line["type"] not in _BUILT_IN_TYPES:  # ours (``issue``): pydantic cannot rebuild
            lines.append(issue(loc, line["msg"], line["input"]))  # it by name; its message
            continue
        detail = InitErrorDetails(type=line["type"], loc=loc, input=line["input"])
        if "ctx" in line:
            detail["ctx"] = line["ctx"]
        lines.append(detail)
    return lines


def raise_if_any(title: str, lines: Sequence[InitErrorDetails]) -> None:
    """Raise one ``ValidationError`` titled ``title`` (a file name or section) if any lines."""
    if lines:
        raise ValidationError.from_exception_data(title, list(lines))


def error_paths(error: ValidationError) -> list[str]:
    """Return each error's location as a dotted path, e.g. ``plugins.2.parameters.seed``."""
    return [".".join(str(part) for part in line["loc"]) for line in error.errors()]


def retitled(error: ValidationError, title: str,
             prefix: Iterable[int | str] = ()) -> ValidationError:
    """Return ``error`` under a new title (the file name) with ``prefix`` added to each path."""
    return ValidationError.from_exception_data(title, rebased(error, tuple(prefix)))
