"""Small factories for QoS test inputs."""

from __future__ import annotations

from typing import Any

from splitserve.components.router.qos import AdmissionRequest, Estimate, QosConfig
from splitserve.components.router.qos.types import RateSource


def config(**fields: Any) -> QosConfig:
    """The default QoS config with ``fields`` overridden (validated as from a file)."""
    return QosConfig.model_validate(fields)


def request(class_name: str = "low", max_tokens: int = 1000,
            prompt_tokens: int = 100) -> AdmissionRequest:
    """An admission request of the given class."""
    return AdmissionRequest(request_id="req-1", class_name=class_name,
                            prompt_tokens=prompt_tokens, max_tokens=max_tokens)


def estimate(ttft: float = 100.0, unloaded: float = 50.0, tpot: float = 20.0,
             source: RateSource = "pool", stale: bool = False,
             decode_source: RateSource | None = None, batch: int = 0,
             unloaded_tpot: float = 0.0) -> Estimate:
    """An estimate with the given totals; ``source`` is the prefill rate's (and the decode
    rate's unless ``decode_source`` is given); ``batch`` > 0 makes the TPOT a batch-aware
    prediction (``tpot_batch``), which may refuse."""
    return Estimate(est_ttft_ms=ttft, est_tpot_ms=tpot, queue_wait_ms=ttft - unloaded,
                    unloaded_ttft_ms=unloaded, prefill_per_token_ms=0.25,
                    decode_per_token_ms=tpot, prefill_source=source, decode_source=decode_source or source,
                    request_tokens=100, prefill_queued_tokens=0.0,
                    prefill_tokens_assumed=False, prefill_workers=1,
                    decode_queued_requests=0, computed_at=10.0,
                    age_s=2.0 if stale else 0.1, stale=stale, tpot_batch=batch,
                    unloaded_tpot_ms=unloaded_tpot)
