"""A component process's log: vLLM's records in the same one-line format as the rest
(Dynamo's logging setup gives them ANSI colours of their own), and a frontend that
imports vLLM for its parsers without vLLM's notes about kernels it never runs."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys

import pytest

from splitserve.components.frontend import formats

pytestmark = pytest.mark.unit

ONE_LINE = re.compile(r"^\d\d:\d\d:\d\d (INFO|WARNING) [\w.]+: .+$")


def run_child(code: str, **env: str) -> str:
    environ = {k: v for k, v in os.environ.items() if k != formats.VLLM_LEVEL_VAR}
    environ.update(env)
    done = subprocess.run([sys.executable, "-c", code], env=environ, capture_output=True,
                          text=True, timeout=120, check=True)
    return done.stderr


def test_vllm_records_are_written_as_every_other_line():
    code = ("import logging\n"
            "from splitserve.contracts.kit.component import configure_logging\n"
            "configure_logging('Worker', 0, 'info')\n"
            "logging.getLogger('vllm.v1.engine.core').info('engine note')\n"
            "logging.getLogger('splitserve.worker').info('own note')\n")
    err = run_child(code)
    assert "\x1b[" not in err  # Dynamo's formatter colours vLLM's lines
    lines = [line for line in err.splitlines() if "note" in line]
    assert len(lines) == 2 and all(ONE_LINE.match(line) for line in lines), err
    assert lines[0].endswith("INFO vllm.v1.engine.core: engine note")


def test_the_parser_import_logs_no_kernel_notes_and_keeps_vllm_warnings():
    code = ("import logging\n"
            "from splitserve.contracts.kit.component import configure_logging\n"
            "configure_logging('Frontend', 0, 'info')\n"
            "from splitserve.components.frontend import formats\n"
            "formats.quiet_engine_logs()\n"
            "import vllm.triton_utils\n"  # what vLLM's parser modules import first
            "logging.getLogger('vllm.parser.parser_manager').info('auto tool choice on')\n"
            "logging.getLogger('vllm.tool_parsers.x').warning('a parser warns')\n")
    err = run_child(code)
    assert "Triton" not in err, err
    assert "auto tool choice on" not in err
    assert "WARNING vllm.tool_parsers.x: a parser warns" in err


def test_a_level_named_in_the_environment_is_left_as_set(monkeypatch):
    names = ("vllm", "vllm.triton_utils.importing")
    before = {n: logging.getLogger(n).level for n in names}
    try:
        monkeypatch.setenv(formats.VLLM_LEVEL_VAR, "DEBUG")
        formats.quiet_engine_logs()
        assert {n: logging.getLogger(n).level for n in names} == before
        monkeypatch.delenv(formats.VLLM_LEVEL_VAR)
        formats.quiet_engine_logs()
        assert logging.getLogger("vllm").level == logging.WARNING
        assert logging.getLogger("vllm.triton_utils.importing").level == logging.ERROR
    finally:
        for n, level in before.items():
            logging.getLogger(n).setLevel(level)
