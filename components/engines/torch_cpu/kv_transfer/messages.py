"""Typed, versioned messages: the etcd agent record and the NIXL notifications.

Notifications are NIXL's small side-channel messages.  Ours start with ``MAGIC`` then
JSON, so a foreign notification (another library sharing the agent) is recognised and
ignored instead of failing validation.  Bytes fields travel as base64.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from .layout import PoolLayout

MAGIC = b"KVX1"
_CFG = ConfigDict(extra="forbid", frozen=True, ser_json_bytes="base64",
                  val_json_bytes="base64")


def agent_key(namespace: str, name: str) -> str:
    """etcd key of an agent's record."""
    return f"splitserve/{namespace}/kv-agents/{name}"


class Region(BaseModel):
    """A registered memory range of an agent."""

    model_config = _CFG
    base_addr: int = Field(ge=0, description="Virtual address of the first byte.")
    nbytes: int = Field(ge=0, description="Length in bytes.")
    mem_type: Literal["DRAM", "VRAM"] = Field(default="DRAM", description="NIXL segment.")
    device_id: int = Field(default=0, ge=0, description="GPU index for VRAM, 0 for DRAM.")


class AgentRecord(BaseModel):
    """Published once per agent start under :func:`agent_key`; removed on close."""

    model_config = _CFG
    version: Literal[1] = 1
    name: str = Field(min_length=1, description="NIXL agent name, unique in the namespace.")
    instance_id: str = Field(min_length=1,
                             description="New on every start: a changed id means the "
                             "peer restarted and cached metadata is stale.")
    backend: str = Field(description="NIXL backend the agent created.")
    pool: Region = Field(description="The KV pool; block i starts at base_addr + i*block_bytes.")
    block_bytes: int = Field(ge=1, description="Bytes of one block.")
    num_blocks: int = Field(ge=1, description="Blocks in the pool.")
    layout: PoolLayout = Field(description="What one block holds.")
    staging: Region | None = Field(default=None, description="Staging pool, if any.")
    nixl_metadata: bytes = Field(description="get_agent_metadata() blob for add_remote_agent.")


class StageRequest(BaseModel):
    """Sender -> receiver: reserve ``nbytes`` of staging for ``request_id``."""

    model_config = _CFG
    v: Literal[1] = 1
    kind: Literal["stage-req"] = "stage-req"
    request_id: str
    instance_id: str = Field(description="Sender's instance; a new one means the receiver "
                             "must reload the sender's metadata before answering.")
    nbytes: int = Field(ge=0)


class StageGrant(BaseModel):
    """Receiver -> sender: the reserved offset, or why there is none."""

    model_config = _CFG
    v: Literal[1] = 1
    kind: Literal["stage-grant"] = "stage-grant"
    request_id: str
    offset: int | None = Field(default=None, ge=0)
    error: str | None = None


class StagedInfo(BaseModel):
    """What the receiver needs to turn a staged payload into its blocks."""

    model_config = _CFG
    offset: int = Field(ge=0, description="Start of the payload in the receiver's staging.")
    nbytes: int = Field(ge=0, description="Bytes written there.")
    src_layout: PoolLayout = Field(description="Layout of the sender's blocks.")
    num_src_blocks: int = Field(ge=0, description="Blocks in the payload.")
    num_tokens: int = Field(ge=0, description="Tokens the payload holds (the rest is padding).")
    dst_block_ids: list[int] = Field(description="Receiver blocks to unpack into.")
    fp8: bool = Field(default=False, description="Payload is FP8 codes followed by scales.")


class KvArrived(BaseModel):
    """Sender -> receiver, sent with the data so it is delivered after it: the request's
    KV (or this rank's shard of it) is in place."""

    model_config = _CFG
    v: Literal[1] = 1
    kind: Literal["arrived"] = "arrived"
    request_id: str
    payload: bytes = Field(default=b"", description="Caller's bytes, e.g. the first token.")
    staged: StagedInfo | None = None


Message = Annotated[StageRequest | StageGrant | KvArrived, Field(discriminator="kind")]
_MESSAGE = TypeAdapter(Message)


def encode(msg: StageRequest | StageGrant | KvArrived) -> bytes:
    """Bytes for ``transfer``/``send_notif``."""
    return MAGIC + msg.model_dump_json().encode()


def decode(raw: bytes) -> StageRequest | StageGrant | KvArrived | None:
    """Called for every notification drained; None when it is not ours or malformed."""
    if not raw.startswith(MAGIC):
        return None
    try:
        return _MESSAGE.validate_json(raw[len(MAGIC):])
    except ValidationError:
        return None
