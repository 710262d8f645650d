"""KvTransferConfig: defaults, strictness and cross-field checks."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from splitserve.components.engines.torch_cpu.kv_transfer import KvTransferConfig

pytestmark = pytest.mark.unit


def test_defaults():
    cfg = KvTransferConfig()
    assert (cfg.backend, cfg.fp8, cfg.progress_thread) == ("UCX", False, False)
    assert all(f.description for f in KvTransferConfig.model_fields.values())


@pytest.mark.parametrize(("fields", "msg"), [
    ({"bogus": 1}, "Extra inputs"),
    ({"poll_initial_s": 0.01, "poll_max_s": 0.001}, "poll_initial_s"),
    ({"staging_align": 3000}, "power of two"),
    ({"fp8": True, "staging_bytes": 0}, "staging_bytes is 0"),
    ({"namespace": "a/b"}, "pattern"),
    ({"timeout_s": 0}, "greater than 0"),
])
def test_rejects(fields, msg):
    with pytest.raises(ValidationError, match=msg):
        KvTransferConfig(**fields)
