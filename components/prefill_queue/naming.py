"""JetStream names for one (namespace, model) prefill queue.

Namespaces and model names come from users ("meta-llama/Llama-3.1-8B-Instruct",
"team a"), but stream and consumer names must be single subject tokens that are also safe
as directory names, and subject tokens may not hold ``.``, ``*``, ``>`` or whitespace.
Every name part therefore goes through ``sanitise_token``: safe names pass unchanged, and
anything rewritten or shortened gets a short hash of the original, so two different inputs
("a/b" and "a_b") never end up sharing one queue.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

# Letters, digits, '_' and '-' are valid in stream, consumer and subject tokens and in file
# names on every platform nats-server runs on.
_SAFE = re.compile(r"^[A-Za-z0-9_-]+$")
_UNSAFE_RUN = re.compile(r"[^A-Za-z0-9_-]+")

SUBJECT_ROOT = "splitserve.prefill"
BELL_ROOT = "splitserve.prefill_bell"
STREAM_PREFIX = "PREFILL"
MAX_TOKEN_LEN = 48


def sanitise_token(name: str, max_len: int = MAX_TOKEN_LEN) -> str:
    """Map any string to a token of ``[A-Za-z0-9_-]``, at most ``max_len`` characters.

    Called when building queue names.  Returns ``name`` itself when it is already safe and
    short enough; otherwise the cleaned, truncated name plus ``_`` and 8 hex digits of the
    original's SHA-1, which keeps distinct inputs distinct.
    """
    if max_len < 10:
        raise ValueError(f"max_len must be at least 10, got {max_len}")
    if _SAFE.match(name) and len(name) <= max_len:
        return name
    digest = hashlib.sha1(name.encode("utf-8")).hexdigest()[:8]
    cleaned = _UNSAFE_RUN.sub("_", name).strip("_")[: max_len - 9]
    return f"{cleaned}_{digest}" if cleaned else f"x_{digest}"


@dataclass(frozen=True)
class QueueNames:
    """Every name one queue uses; level 0 is the highest priority."""

    stream: str
    subjects: tuple[str, ...]
    consumers: tuple[str, ...]
    bell: str

    @property
    def levels(self) -> int:
        """Number of priority levels (one subject and one consumer each)."""
        return len(self.subjects)

    @property
    def targeted(self) -> tuple[str, ...]:
        """Per level, the wildcard of the jobs queued for one prefill worker (prefix
        affinity): ``<level subject>.w.<worker>``, which the level's shared consumer
        (filtered on the level subject itself) never sees."""
        return tuple(f"{s}.w.*" for s in self.subjects)

    def worker_subject(self, level: int, worker: str) -> str:
        """Subject of a job at ``level`` queued for prefill worker ``worker`` (its id in
        hex, as its presence endpoint and handoffs name it)."""
        return f"{self.subjects[level]}.w.{sanitise_token(worker)}"

    def worker_consumer(self, level: int, worker: str) -> str:
        """Durable consumer of ``worker``'s own jobs at ``level``; any worker may pull
        from it (a job its owner left waiting is taken by an idle sibling)."""
        return f"{self.consumers[level]}-w-{sanitise_token(worker)}"

    def consumer_owner(self, consumer: str) -> tuple[int, str] | None:
        """(level, worker) of a worker's own consumer, None for any other name."""
        for level, shared in enumerate(self.consumers):
            prefix = f"{shared}-w-"
            if consumer.startswith(prefix) and len(consumer) > len(prefix):
                return level, consumer[len(prefix):]
        return None


def queue_names(namespace: str, model: str, levels: int) -> QueueNames:
    """Build the names of the queue for ``namespace`` and ``model`` with ``levels`` levels.

    Called once by the adapter at construction.  Levels are named by index (``p0``,
    ``p1``...) rather than class name so renaming a priority class keeps the stream.
    """
    if levels < 1:
        raise ValueError(f"a queue needs at least one priority level, got {levels}")
    ns, md = sanitise_token(namespace), sanitise_token(model)
    base = f"{SUBJECT_ROOT}.{ns}.{md}"
    return QueueNames(
        stream=f"{STREAM_PREFIX}_{ns}_{md}",
        subjects=tuple(f"{base}.p{i}" for i in range(levels)),
        consumers=tuple(f"prefill-p{i}" for i in range(levels)),
        bell=f"{BELL_ROOT}.{ns}.{md}",
    )
