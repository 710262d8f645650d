"""``PrefillQueueConfig``: limits and timings of the prefill work queue.

Every limit here is enforced by the NATS server (stream and consumer settings), except
``depth_refresh_s``, ``idle_recheck_s``, ``steal_after_s`` and ``request_timeout_s``,
which shape the client.  ``PrefillAffinityConfig``: how a decode worker picks the prefill
worker that holds a prompt's prefix.  Validators only check; they never change values.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from splitserve.contracts.priority import DEFAULT_TABLE, PriorityTable


class PrefillQueueConfig(BaseModel):
    """One queue per (namespace, model); every decode and prefill worker of it uses this."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_msgs: int = Field(
        default=1000, ge=1,
        description="Most prefill requests the queue holds (all levels together, queued "
        "or being worked on). A publish beyond it is rejected with QueueFull.")
    max_bytes: int = Field(
        default=256 * 1024 * 1024, ge=1024,
        description="Most bytes the queue holds; a publish beyond it is rejected with "
        "QueueFull.")
    max_age_s: float = Field(
        default=120.0, gt=0,
        description="A request older than this is deleted by the server, acked or not. "
        "Keep it above the decode workers' remote-prefill timeout.")
    ack_wait_s: float = Field(
        default=30.0, gt=0,
        description="How long a pulled request may go without ack or in_progress before "
        "the server redelivers it to another prefill worker (the dead-worker timeout).")
    max_deliver: int = Field(
        default=3, ge=1,
        description="Deliveries of one request before the server stops redelivering it.")
    priorities: tuple[str, ...] = Field(
        default=DEFAULT_TABLE.classes, min_length=1, max_length=8,
        description="Priority class names, highest first; one subject and one consumer "
        "each. Keep them the QoS section's classes, in its order (the default is the "
        "built-in classes'): a job carries its class's level in that order (0 = "
        "highest) and is queued at that level, or at the last one when it is past it. "
        "Names rank only the jobs of decode workers that send a class name.")
    default_priority: str = Field(
        default=DEFAULT_TABLE.default,
        description="Level for jobs whose class name is not in `priorities`.")
    depth_refresh_s: float = Field(
        default=0.2, ge=0.01, le=10.0,
        description="How often QueueDepthMonitor re-reads the depth from the server.")
    idle_recheck_s: float = Field(
        default=0.25, gt=0, le=10.0,
        description="An idle prefill worker rescans the levels at least this often even "
        "without an enqueue notification (redeliveries send none).")
    steal_after_s: float = Field(
        default=0.5, gt=0, le=60.0,
        description="A job queued for one prefill worker (the decode worker's prefix "
        "affinity) that has waited this long unstarted is taken by any idle prefill "
        "worker: its owner is busy, stuck or gone, and computing the prompt elsewhere "
        "now beats waiting for the cached prefix.")
    request_timeout_s: float = Field(
        default=1.0, gt=0, le=30.0,
        description="Longest wait for the server's answer to a publish, pull or ack.")
    duplicate_window_s: float = Field(
        default=60.0, ge=0,
        description="A request id published twice within this window is stored once "
        "(safe enqueue retries); 0 turns deduplication off.")
    storage: Literal["file", "memory"] = Field(
        default="file", description="JetStream storage: file survives a server restart.")
    replicas: int = Field(default=1, ge=1, le=5,
                          description="Stream replicas in a clustered NATS deployment.")

    @model_validator(mode="after")
    def _check_priorities(self) -> PrefillQueueConfig:
        if any(not p for p in self.priorities):
            raise ValueError("priority class names must be non-empty")
        if len(set(self.priorities)) != len(self.priorities):
            raise ValueError(f"priority class names must be unique, got {list(self.priorities)}")
        if self.default_priority not in self.priorities:
            raise ValueError(f"default_priority {self.default_priority!r} is not one of "
                             f"priorities {list(self.priorities)}")
        if self.duplicate_window_s > self.max_age_s:
            raise ValueError(f"duplicate_window_s ({self.duplicate_window_s}) must not "
                             f"exceed max_age_s ({self.max_age_s})")
        return self

    def table(self) -> PriorityTable:
        """The levels as a priority table (``contracts/priority.py``)."""
        return PriorityTable(self.priorities, self.default_priority)


class PrefillAffinityConfig(BaseModel):
    """A decode worker's prefix affinity for remote prefill (``components/disagg/
    affinity.py``): it remembers which prefill worker computed which prompt blocks (from
    the workers' handoffs) and queues a job for the live worker where the prompt costs
    least, its prefix hit against the jobs already queued for it, or in the shared queue
    when no worker holds any of it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enable: bool = Field(default=True, description="Queue a job for the prefill worker "
                         "that holds its prefix; false: every job in the shared queue.")
    block_size: int = Field(default=64, ge=1, le=4096, description="Tokens per remembered "
                            "block (a prefix is credited in whole blocks).")
    unheld: Literal["shared", "least-queued"] = Field(
        default="shared", description="A prompt no live worker holds any of: `shared` "
        "queues it in the shared queue (whichever worker frees up first takes it); "
        "`least-queued` for the worker with the fewest jobs queued for it, remembered "
        "there at once, so the prompts that share its prefix follow it before it ran.")
    share: bool = Field(
        default=True, description="Tell the other decode workers where each job was "
        "queued and which worker computed it (one NATS subject), so a prompt's followers "
        "that another decode worker receives go to the same prefill worker; false: each "
        "decode worker knows only its own jobs.")
    capacity_tokens: int = Field(
        default=500_000, ge=1, description="Prompt tokens remembered per prefill worker, "
        "least recently computed forgotten first: about the prefill engine's KV capacity.")
