"""PrefillQueueConfig is strict and checks its cross-field rules."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from splitserve.components.prefill_queue import PrefillQueueConfig

pytestmark = pytest.mark.unit


def test_defaults_are_valid_and_bounded() -> None:
    cfg = PrefillQueueConfig()
    assert cfg.max_msgs > 0 and cfg.max_bytes > 0 and cfg.max_age_s > 0
    assert cfg.default_priority in cfg.priorities


@pytest.mark.parametrize("fields, message", [
    ({"max_msgs": 0}, "max_msgs"),
    ({"ack_wait_s": 0}, "ack_wait_s"),
    ({"max_deliver": 0}, "max_deliver"),
    ({"unknown_key": 1}, "unknown_key"),
    ({"priorities": []}, "priorities"),
    ({"priorities": ["a", "a"], "default_priority": "a"}, "unique"),
    ({"priorities": ["a", ""], "default_priority": "a"}, "non-empty"),
    ({"priorities": ["hi", "lo"]}, "default_priority 'default'"),
    ({"max_age_s": 10, "duplicate_window_s": 20}, "duplicate_window_s"),
    ({"storage": "disk"}, "storage"),
])
def test_invalid_configs_name_the_field(fields: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        PrefillQueueConfig.model_validate(fields)


def test_json_schema_describes_every_field() -> None:
    props = PrefillQueueConfig.model_json_schema()["properties"]
    assert all(p.get("description") for p in props.values())
