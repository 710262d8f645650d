"""FrontendConfig: the request-limit settings, their defaults and their bounds."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from splitserve.components.frontend.config import FrontendConfig

pytestmark = pytest.mark.unit


def test_request_limit_defaults():
    cfg = FrontendConfig()
    assert (cfg.max_body_bytes, cfg.max_header_bytes) == (4 * 1024 * 1024, 16 * 1024)
    assert (cfg.header_timeout_s, cfg.body_timeout_s, cfg.keep_alive_timeout_s) == (10, 30, 30)
    assert (cfg.max_connections, cfg.tokenizer_threads, cfg.max_pending_tokenizations) == \
        (1024, 2, 1024)
    assert (cfg.max_tokenization_wait_s, cfg.max_inflight) == (2.0, 4096)


@pytest.mark.parametrize("field, value", [
    ("max_body_bytes", 10), ("max_header_bytes", 0), ("header_timeout_s", 0),
    ("body_timeout_s", -1), ("keep_alive_timeout_s", 0), ("max_connections", 0),
    ("tokenizer_threads", 0), ("max_pending_tokenizations", 0), ("max_tokenization_wait_s", 0), ("max_body_byte", 5000),
])
def test_request_limits_are_checked(field, value):
    with pytest.raises(ValidationError, match=field):
        FrontendConfig(**{field: value})
