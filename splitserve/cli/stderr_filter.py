"""This process's standard error with Dynamo's per-request span lines left out.

Dynamo 1.6.1's runtime logs a "route request completed" span event at INFO for every
request its client makes, whatever ``DYN_LOG`` says, straight to file descriptor 2 from
its own threads.  ``dynamo serve`` keeps such lines out of its console
(``splitserve.serve.supervisor.console_worthy``); a CLI command that calls a live graph
through Dynamo's client (``dynamo route explain``) filters them the same way around the
call: descriptor 2 is pointed at a pipe whose reader copies every other line back.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Iterator

from splitserve.serve.supervisor import console_worthy


@contextlib.contextmanager
def without_request_spans() -> Iterator[None]:
    """Within the block, lines written to descriptor 2 that are Dynamo's per-request
    span events are dropped; every other line reaches standard error as before."""
    with contextlib.suppress(AttributeError, ValueError, OSError):
        sys.stderr.flush()
    saved = os.dup(2)
    read_fd, write_fd = os.pipe()
    os.dup2(write_fd, 2)
    os.close(write_fd)

    def pump() -> None:
        with os.fdopen(read_fd, "rb") as pipe:
            for line in pipe:
                if console_worthy(line, verbose=False):
                    os.write(saved, line)

    reader = threading.Thread(target=pump, name="stderr-filter", daemon=True)
    reader.start()
    try:
        yield
    finally:
        with contextlib.suppress(AttributeError, ValueError, OSError):
            sys.stderr.flush()
        os.dup2(saved, 2)  # the pipe's last writer is gone: the reader sees its end
        reader.join(timeout=5.0)
        os.close(saved)
