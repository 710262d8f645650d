"""Config sections of DecodeWorker / PrefillWorker with ``engine: mocker``.

Kept apart from the torch sections (``components/worker/disagg_config.py``, which
selects between both) because those import the KV-transfer stack, and with it torch:
about 1 s and 300 MiB per process that a mocker replica has no use for.  The policy,
queue and timing fields come from the sections every engine shares
(``components/engines/disagg_sections.py``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from splitserve.components.engines.disagg_sections import (
    EngineDecodeSection,
    EnginePrefillSection,
)

from .config import MockerEngineArgs


def _check_engine_args(args: MockerEngineArgs) -> MockerEngineArgs:
    # The component starts each engine in the mode its role needs; another mode written
    # in the section would be silently ignored, so it is refused.  (The default cannot be
    # told apart from an explicit "agg": resolved run configs carry every field.)
    if args.disaggregation_mode != "agg":
        raise ValueError(f"disaggregation_mode {args.disaggregation_mode!r} is ignored here: "
                         "the DecodeWorker / PrefillWorker component chooses each engine's "
                         "mode; remove it from engine_args")
    if args.workers_per_process != 1:
        raise ValueError(f"workers_per_process must be 1 for disaggregated workers (one "
                         f"engine per role and replica), got {args.workers_per_process}")
    return args


class MockerDecodeWorkerConfig(EngineDecodeSection):
    """A decode worker fronting two mocker engines: a decode-mode engine for requests
    prefilled remotely, and an aggregated engine for local prefills (a decode-mode mocker
    does not simulate prefill compute)."""

    engine: Literal["mocker"] = "mocker"
    engine_args: MockerEngineArgs = Field(
        default_factory=MockerEngineArgs, description="Arguments of both engines of this "
        "replica; `disaggregation_mode` is set per engine by the component.")
    engine_idle_timeout_s: float = Field(
        60.0, gt=0, description="Longest wait for the next chunk from an engine before the "
        "request ends with an error (a malformed request can hang a mocker stream).")

    @field_validator("engine_args")
    @classmethod
    def _engine_args_fit(cls, v: MockerEngineArgs) -> MockerEngineArgs:
        return _check_engine_args(v)


class MockerPrefillWorkerConfig(EnginePrefillSection):
    """A prefill worker fronting one prefill-mode mocker engine: pulls jobs, runs the
    simulated prefill (and KV transfer delay), hands the result to the decode worker."""

    engine: Literal["mocker"] = "mocker"
    engine_args: MockerEngineArgs = Field(
        default_factory=MockerEngineArgs, description="Arguments of the prefill engine; "
        "`disaggregation_mode` is set by the component. `kv_transfer_bandwidth` sets the "
        "simulated transfer time (prompt tokens x KV bytes per token / bandwidth).")
    max_concurrent_jobs: int = Field(16, ge=1, description="Prefill jobs in flight at once "
                                     "(the engine batches their prompts).")
    handoff_timeout_s: float = Field(
        5.0, gt=0, description="How long to wait for the decode worker to confirm a "
        "prefill result before handing the job back to the queue.")
    engine_idle_timeout_s: float = Field(
        60.0, gt=0, description="Longest wait for the next chunk from the engine before "
        "the job is handed back.")

    @field_validator("engine_args")
    @classmethod
    def _engine_args_fit(cls, v: MockerEngineArgs) -> MockerEngineArgs:
        return _check_engine_args(v)
