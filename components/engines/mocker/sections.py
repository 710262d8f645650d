"""Config sections with ``engine: mocker``: Worker, DecodeWorker and PrefillWorker.

The policy, queue and timing fields come from the sections every engine shares
(``contracts/sections.py``); ``SECTIONS`` is what the engine registry reads.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, field_validator

from splitserve.contracts.sections import (
    EngineDecodeSection,
    EnginePrefillSection,
    WorkerCommon,
)

from .config import MockerEngineArgs


class _Simulated:
    """What the plan's checks ask of every section with a mocker engine."""

    context_unbounded: ClassVar[bool] = True
    """The mocker only simulates the KV cache, so it may be given a context window beyond
    the model's own (a long-context fleet replayed with a small model)."""


class MockerWorkerSection(_Simulated, WorkerCommon):
    """A Worker running Dynamo's mocker: the mocker child serves `generate` itself."""

    engine: Literal["mocker"] = "mocker"
    engine_args: MockerEngineArgs = Field(default_factory=MockerEngineArgs)

    @field_validator("load_report_interval_s")
    @classmethod
    def _no_load_reports(cls, v: float) -> float:
        # The child publishes its own load (Dynamo's metrics), so an interval written
        # here would be silently ignored; only the default (which resolved run configs
        # always carry) is accepted.
        default = WorkerCommon.model_fields["load_report_interval_s"].default
        if v != default:
            raise ValueError(f"load_report_interval_s is not used by a mocker Worker (the "
                             f"mocker publishes its own load); remove it (got {v})")
        return v


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


class MockerDecodeWorkerConfig(_Simulated, EngineDecodeSection):
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


class MockerPrefillWorkerConfig(_Simulated, EnginePrefillSection):
    """A prefill worker fronting one prefill-mode mocker engine: pulls jobs, runs the
    simulated prefill (and KV transfer delay), hands the result to the decode worker."""

    engine: Literal["mocker"] = "mocker"
    engine_args: MockerEngineArgs = Field(
        default_factory=MockerEngineArgs, description="Arguments of the prefill engine; "
        "`disaggregation_mode` is set by the component. `kv_transfer_bandwidth` sets the "
        "simulated transfer time (prompt tokens x KV bytes per token / bandwidth).")
    max_concurrent_jobs: int = Field(16, ge=1, description="Prefill jobs in flight at once "
                                     "(the engine batches their prompts).")
    engine_idle_timeout_s: float = Field(
        60.0, gt=0, description="Longest wait for the next chunk from the engine before "
        "the job is handed back.")

    @field_validator("engine_args")
    @classmethod
    def _engine_args_fit(cls, v: MockerEngineArgs) -> MockerEngineArgs:
        return _check_engine_args(v)


SECTIONS = {"agg": MockerWorkerSection, "decode": MockerDecodeWorkerConfig,
            "prefill": MockerPrefillWorkerConfig}
