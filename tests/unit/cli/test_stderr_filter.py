"""`dynamo route explain` keeps Dynamo's per-request span lines off standard error
(Dynamo 1.6.1 writes one per request to descriptor 2 whatever DYN_LOG says) and lets
every other line through, before, within and after the filtered block."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.unit

SPAN = ("\x1b[2m2026-12-02T06:46:33Z\x1b[0m INFO router.route_request: request_span: "
        "route request completed request_id=x")

SCRIPT = textwrap.dedent(f"""
    import os, sys, threading
    from splitserve.cli.stderr_filter import without_request_spans
    os.write(2, b"before\\n")
    with without_request_spans():
        os.write(2, {SPAN!r}.encode() + b"\\n")
        t = threading.Thread(target=lambda: os.write(2, b"from a thread\\n"))
        t.start(); t.join()
        print("a Python error line", file=sys.stderr)
        os.write(2, b"no newline at the end")
    os.write(2, b"\\nafter\\n")
    print("stdout untouched")
""")


def test_span_lines_are_dropped_and_every_other_line_kept():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "stdout untouched\n"
    assert done.stderr == ("before\nfrom a thread\na Python error line\n"
                           "no newline at the end\nafter\n")
