"""The priority vocabulary: the classes' names, their one order, and how a name ranks.

A ``PriorityTable`` lists the priority classes most important first.  Its source is the
QoS section's ``classes`` (``QosConfig.priority_table()``, the router's and an in-process
frontend's); ``DEFAULT_TABLE`` is the built-in classes' table (``high``, ``default``,
``low``), which the prefill queue's levels default to and which ranks the requests no
QoS section placed.

A class's **level** is its position in the table: 0 is the most important.  It is the
project's one number for a priority:

- the router puts the level of the class it resolved on its reply
  (``RouteReply.class_level``); the frontend carries it to the worker
  (``RequestMeta.priority_level``), whose shells hand it to the engine as
  ``GenerateParams.priority``;
- the decode worker puts it on the prefill job (``PrefillRequest.priority``): the queue
  serves it at that level (its last level when the table is longer) and the prefill
  worker's engine schedules it at that level;
- each engine maps it once, in its own folder, to its scheduler's convention (the
  torch engine serves higher values first, vLLM lower values first, SGLang higher ones
  unless told otherwise).

Names: ``level`` refuses a name the table lacks (``UnknownPriority``).  Where a name
arrives that no QoS section resolved (a worker request without a level, a prefill job
from a decode worker of an earlier release), ``resolve`` applies the one rule: the name
is compared case- and space-insensitively, and a name the table lacks, or none, is the
table's default class, exactly as ``resolve_class`` treats an unknown class (reason
``unknown-class``).  Nothing else ranks a name.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_CLASSES: tuple[str, ...] = ("high", "default", "low")
"""The built-in QoS classes' names, most important first (``components/router/qos/classes.py``
builds its default classes from these)."""

DEFAULT_CLASS = "default"
"""The class of a request that names none (the QoS section's ``default_class``)."""


class UnknownPriority(ValueError):
    """A class name the priority table lacks."""


@dataclass(frozen=True)
class PriorityTable:
    """Priority class names, most important first, and the class of requests that name
    none (or one the table lacks)."""

    classes: tuple[str, ...] = DEFAULT_CLASSES
    default: str = DEFAULT_CLASS

    def __post_init__(self) -> None:
        if not self.classes or any(not c for c in self.classes):
            raise ValueError(f"priority classes must be non-empty names, got "
                             f"{list(self.classes)}")
        if len(set(self.classes)) != len(self.classes):
            raise ValueError(f"priority class names must be unique, got {list(self.classes)}")
        if self.default not in self.classes:
            raise ValueError(f"default class {self.default!r} is not one of "
                             f"{list(self.classes)}")

    def level(self, name: str) -> int:
        """The level of class ``name`` (0 = most important); refuses a name the table
        lacks, naming the classes it has."""
        try:
            return self.classes.index(name)
        except ValueError:
            raise UnknownPriority(f"unknown priority class {name!r}; the classes are "
                                  f"{list(self.classes)}") from None

    @property
    def default_level(self) -> int:
        """The level of the default class."""
        return self.classes.index(self.default)

    @property
    def lowest_level(self) -> int:
        """The level of the least important class."""
        return len(self.classes) - 1

    def resolve(self, name: str | None) -> str:
        """The class a name from outside the table's own config stands for: the name
        itself (case and surrounding space ignored), or the default class for none, an
        empty one or one the table lacks (the module's rule)."""
        if name in self.classes:
            return name
        wanted = (name or "").strip().lower()
        return wanted if wanted in self.classes else self.default

    def level_of(self, name: str | None) -> int:
        """``level(resolve(name))``: the level of a name under the module's rule."""
        return self.classes.index(self.resolve(name))


DEFAULT_TABLE = PriorityTable()
"""The built-in classes' table."""

DEFAULT_LEVEL = DEFAULT_TABLE.default_level
"""The level of a request nothing ranked (the built-in ``default`` class's, 1)."""
