"""``KvTransferConfig``: settings of one KV transfer agent (prefill or decode side).

Validators only check; they never change values.  The agent takes the endpoints and the
namespace as explicit arguments, so nothing here reads the environment.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator


class KvTransferConfig(BaseModel):
    """Shared by both sides; the fields that matter to only one side say so."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    backend: str = Field(
        default="UCX", min_length=1,
        description="NIXL backend plugin that moves the bytes. UCX picks shared memory, "
        "CMA or TCP for DRAM on one host and RDMA/NVLink between GPUs.")
    progress_thread: bool = Field(
        default=False,
        description="Run NIXL's progress thread. It spins on a whole core (NIXL sets no "
        "delay), which a 2-core machine cannot spare; off, progress is made by our "
        "completion checks and notification drains. A write completes only after the "
        "receiver made progress, so with the thread off on the receiver a transfer "
        "takes at least about one notif_poll_s; turn it on on decode workers with a "
        "core to spare.")
    namespace: str = Field(
        default="default", min_length=1, pattern=r"^[A-Za-z0-9_.-]+$",
        description="Dynamo namespace; agent records live under "
        "splitserve/<namespace>/kv-agents/<agent name> in etcd.")
    timeout_s: float = Field(
        default=10.0, gt=0, le=600,
        description="Longest wait for one write (posting to completion), and the default "
        "for wait_for on the decode side.")
    grant_timeout_s: float = Field(
        default=2.0, gt=0, le=60,
        description="Sender side, staged path: longest wait for the receiver to answer a "
        "staging request. A receiver that does not run its poller cannot answer.")
    poll_spin_s: float = Field(
        default=0.003, ge=0, le=0.1,
        description="For this long after posting, completion is checked at every turn of "
        "the event loop (no sleep): asyncio cannot sleep less than about 1 ms, and a "
        "write completes about one receiver poll (notif_poll_s) after posting, so a "
        "spin a little longer than that catches it at once.")
    poll_initial_s: float = Field(
        default=0.001, gt=0, le=0.1,
        description="First sleep between completion checks after the spin; doubles up to "
        "poll_max_s so long transfers cost little CPU.")
    poll_max_s: float = Field(
        default=0.002, gt=0, le=1.0,
        description="Largest sleep between completion checks of a posted transfer.")
    notif_poll_s: float = Field(
        default=0.001, gt=0, le=1.0,
        description="How often the background poller drains NIXL notifications (arrivals, "
        "staging requests and grants) while a transfer is expected: a request waits for "
        "its KV, blocks are reserved for one, or one was seen within notif_busy_s.")
    notif_busy_s: float = Field(
        default=1.0, ge=0, le=60.0,
        description="How long the poller keeps polling every notif_poll_s after the last "
        "expected transfer or notification, before it slows to notif_idle_poll_s.")
    notif_idle_poll_s: float = Field(
        default=0.05, gt=0, le=5.0,
        description="How often the poller drains notifications while no transfer is "
        "expected (an idle worker then costs almost no CPU); an expected transfer "
        "(``expect``, ``wait_for``) wakes it at once.")
    staging_bytes: int = Field(
        default=64 * 1024 * 1024, ge=0,
        description="Size of the registered staging pool. Receiver: payloads that need a "
        "layout transform land here. Sender: FP8-compressed payloads are built here. "
        "0 disables the staged path on this agent.")
    staging_align: int = Field(
        default=4096, ge=8,
        description="Alignment of staging regions in bytes (a power of two, at least 8 so "
        "fp32 scales can be viewed in place).")
    fp8: bool = Field(
        default=False,
        description="Sender side: compress staged payloads to FP8 e4m3 with one scale per "
        "(block, layer, K/V) before sending; error at most amax/28 per group. The direct "
        "path never compresses.")
    force_staged: bool = Field(
        default=False,
        description="Sender side: take the staged path even when layouts match (tests, "
        "and to use fp8 between identical layouts).")

    @model_validator(mode="after")
    def _check(self) -> KvTransferConfig:
        if self.poll_initial_s > self.poll_max_s:
            raise ValueError(f"poll_initial_s ({self.poll_initial_s}) must not exceed "
                             f"poll_max_s ({self.poll_max_s})")
        if self.staging_align & (self.staging_align - 1):
            raise ValueError(f"staging_align ({self.staging_align}) must be a power of two")
        if self.fp8 and self.staging_bytes == 0:
            raise ValueError("fp8 (True) needs a staging pool, but staging_bytes is 0")
        return self
