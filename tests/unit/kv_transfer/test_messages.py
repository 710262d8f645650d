"""Wire messages and the etcd record: round trips, strictness, foreign notifications."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from splitserve.components.engines.torch_cpu.kv_transfer import AgentRecord, agent_key
from splitserve.components.engines.torch_cpu.kv_transfer.messages import (
    MAGIC,
    KvArrived,
    Region,
    StagedInfo,
    StageGrant,
    StageRequest,
    decode,
    encode,
)

from .factories import layout

pytestmark = pytest.mark.unit


def _record() -> AgentRecord:
    return AgentRecord(name="decode-0", instance_id="abc", backend="UCX",
                       pool=Region(base_addr=0x7F00_0000_0000, nbytes=10 * 768),
                       block_bytes=768, num_blocks=10, layout=layout(),
                       nixl_metadata=bytes(range(256)) * 2)


def test_agent_key():
    assert agent_key("prod", "decode-0") == "splitserve/prod/kv-agents/decode-0"


def test_record_round_trip_keeps_binary_metadata():
    rec = _record()
    text = rec.model_dump_json()
    assert '"version":1' in text
    back = AgentRecord.model_validate_json(text)
    assert back == rec and back.nixl_metadata == bytes(range(256)) * 2


def test_record_rejects_unknown_keys_and_versions():
    data = _record().model_dump(mode="json")
    with pytest.raises(ValidationError):
        AgentRecord.model_validate({**data, "extra": 1})
    with pytest.raises(ValidationError):
        AgentRecord.model_validate({**data, "version": 2})


@pytest.mark.parametrize("msg", [
    StageRequest(request_id="r1", nbytes=4096, instance_id="i"),
    StageGrant(request_id="r1", offset=8192),
    StageGrant(request_id="r1", error="staging full"),
    KvArrived(request_id="r1", payload=b"\x00\xfftok"),
    KvArrived(request_id="r2", staged=StagedInfo(
        offset=0, nbytes=100, src_layout=layout(), num_src_blocks=2, num_tokens=7,
        dst_block_ids=[4, 1], fp8=True)),
])
def test_notification_round_trip(msg):
    raw = encode(msg)
    assert raw.startswith(MAGIC)
    assert decode(raw) == msg


@pytest.mark.parametrize("raw", [b"", b"hello", MAGIC + b"not json", MAGIC + b'{"kind":"x"}',
                                 MAGIC + b'{"v":2,"kind":"arrived","request_id":"r"}'])
def test_foreign_or_bad_notifications_are_ignored(raw):
    assert decode(raw) is None
