"""The fields every engine's worker sections share, by role: `Worker:` (aggregated),
`DecodeWorker:` and `PrefillWorker:`.

Each engine's own sections (``components/engines/<name>/sections.py``) add its
``engine: <name>`` literal and its ``engine_args``; the registry
(``components/worker/registry.py``) picks the section model from the ``engine`` key.
The offload policy, the prefill queue and the timings mean the same for every engine,
so one YAML shape fits all.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import Field, field_validator, model_validator

from splitserve.contracts.prefill_queue import PrefillAffinityConfig, PrefillQueueConfig
from splitserve.contracts.config import ComponentConfig
from splitserve.contracts.kit.loras import ADAPTER_CONFIG, lora_name_problem
from splitserve.contracts.models import StrictModel


def refuse_torch_tier_fields(data: Any, instead: dict[str, str], engine: str) -> Any:
    """``data`` unchanged, or ValueError naming the first torch-engine KV tier field it
    sets, this engine and what it offers ``instead`` (a model validator's ``before``
    step: a plain "extra inputs" error would not say that the engine has its own)."""
    if isinstance(data, dict):
        for key, offered in instead.items():
            if key in data:
                raise ValueError(f"{key}: a field of the torch engine, not of "
                                 f"engine: {engine}; {offered}")
    return data


def router_block_size(sections: dict[str, Any], field: str, size: int, engine: str
                      ) -> list[str]:
    """A graph check for an engine whose KV events the router indexes block by block:
    the Router's ``block_size`` must be the engine's (``field`` of its ``engine_args``,
    ``size`` tokens), or every prefix lookup would miss, silently.  Called by the engine
    sections' ``graph_checks``; returns the problem, if any."""
    router = getattr(sections.get("Router"), "block_size", None)
    if router is not None and router != size:
        return [f"engine_args.{field}: {size} differs from Router.block_size {router}; the "
                f"router must use {engine}'s block size"]
    return []


class Draining(StrictModel):
    """How long a leaving worker lets its work finish: a worker section's field, read by
    the shells as it is declared here."""

    drain_timeout_s: float = Field(30.0, gt=0, description="On shutdown, how long in-flight "
                                   "requests may take to finish after deregistration.")


class WorkerCommon(ComponentConfig, Draining):
    """Fields every engine's worker has, whatever its role."""

    load_report_interval_s: float = Field(0.2, gt=0, description="How often the worker "
                                          "publishes its load (active, waiting, KV usage).")
    loras: dict[str, str] = Field(
        default_factory=dict, description="LoRA adapters served from the start: name -> "
        "PEFT adapter directory (with adapter_config.json).  Each replica writes them to "
        "etcd and loads them like adapters loaded at run time (docs/lora.md); clients "
        "send the name as the OpenAI `model`.  Needs an engine that serves LoRA; "
        "`dynamo lora unload` refuses them (remove them here instead).")
    dynamo_model_card: bool = Field(
        False, description="Also register a Dynamo model card for each aggregated replica "
        "(Dynamo's `register_llm`: token input, chat and completions, the model's "
        "directory and served name, the engine's KV block size), so Dynamo's own frontend "
        "discovers these workers and drives them: to put Dynamo's frontend in front of "
        "this project's engines (a comparison, a migration).  Their generate endpoint "
        "already takes Dynamo's preprocessed requests.  Aggregated Workers only.")

    @field_validator("loras")
    @classmethod
    def _adapter_names(cls, v: dict[str, str]) -> dict[str, str]:
        bad = [p for p in map(lora_name_problem, v) if p]
        if bad:
            raise ValueError("; ".join(bad))
        return v

    def preflight(self) -> list[str]:
        """The static adapters' directories exist and hold an adapter_config.json (a
        typo fails the plan, not every replica's load)."""
        out = []
        for name, path in self.loras.items():
            if not (Path(path) / ADAPTER_CONFIG).is_file():
                out.append(f"loras.{name}: {path!r} is not a LoRA adapter directory "
                           f"(no {ADAPTER_CONFIG})")
        return [*super().preflight(), *out]


def aggregated_only(card: bool, why: str) -> bool:
    """Refuse ``dynamo_model_card`` on a worker that is not an aggregated one."""
    if card:
        raise ValueError(f"dynamo_model_card: aggregated Workers only ({why})")
    return card


class DecodeTimings(StrictModel):
    """How a decode worker waits for remote prefill.  Declared once: the decode section
    (YAML) and the decode coordinator's settings both inherit these fields."""

    remote_prefill_timeout_s: float = Field(
        30.0, gt=0, description="How long to wait for a remote prefill's handoff before "
        "prefilling locally (engines that can) or answering 503 (engines that cannot).")
    no_prefill_worker_wait_s: float = Field(
        5.0, ge=0, description="An engine that cannot prefill locally: how long a request "
        "waits for a live prefill worker before it is answered 503 with Retry-After.")
    retry_after_s: float = Field(
        2.0, gt=0, description="Retry-After of that 503 (seconds).")


class EngineDecodeSection(WorkerCommon, DecodeTimings):
    """Common fields of a decode worker (which runs the offload decider)."""

    @field_validator("dynamo_model_card")
    @classmethod
    def _no_card(cls, v: bool) -> bool:
        return aggregated_only(v, "a decode worker needs this project's disaggregated "
                               "router in front of it")

    disaggregated_router: dict[str, Any] = Field(
        default_factory=lambda: {"enable": True},
        description="The offload policy (`enable`, `decider`: score | threshold | forced, "
        "and the decider's parameters); the seed's score-based YAML loads as written.")
    prefill_queue: PrefillQueueConfig = Field(default_factory=PrefillQueueConfig)
    prefill_affinity: PrefillAffinityConfig = Field(default_factory=PrefillAffinityConfig)


class PrefillTimings(StrictModel):
    """How a prefill worker works through its jobs.  Declared once: the prefill section
    (YAML) and the prefill loop's settings both inherit these fields."""

    max_concurrent_jobs: int = Field(8, ge=1, description="Prefill jobs in flight at once "
                                     "(the engine batches their prompts).")
    max_inflight_tokens: int = Field(
        16384, ge=0, description="Prompt tokens to compute (uncached) this worker takes "
        "on at once: it takes the next job only while its jobs in flight hold fewer, one "
        "job at a time, so a burst spreads over every prefill worker instead of queueing "
        "inside the first one that pulled (a job larger than this still runs alone). 0: "
        "no token bound, jobs taken up to max_concurrent_jobs in one pull.")
    handoff_timeout_s: float = Field(
        5.0, gt=0, description="How long to wait for the decode worker to confirm a "
        "prefill result before handing the job back to the queue.")
    prefill_timeout_s: float = Field(
        120.0, gt=0, description="A prefill that takes longer is aborted and its job "
        "handed back to the queue.")


class EnginePrefillSection(WorkerCommon, PrefillTimings):
    """Common fields of a prefill worker (which runs the prefill loop)."""

    prefill_queue: PrefillQueueConfig = Field(default_factory=PrefillQueueConfig)

    @field_validator("dynamo_model_card")
    @classmethod
    def _no_card(cls, v: bool) -> bool:
        return aggregated_only(v, "a prefill worker takes jobs from the prefill queue, "
                               "not requests")

    @model_validator(mode="after")
    def _no_adapters(self) -> EnginePrefillSection:
        if self.loras:
            raise ValueError("loras: a prefill worker loads the adapters its decode "
                             "workers serve (from etcd), none of its own; list them under "
                             "DecodeWorker.loras")
        return self
