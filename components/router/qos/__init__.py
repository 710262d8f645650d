"""QoS core: priority classes, the latency estimator, admission and graceful degradation.

Pure code: adapters pass in what they observed (and ``now``) and act on the returned
data.  Typical use per request (the router's adapter)::

    resolution = resolve_class(header, user, metadata, config)
    estimate = predictor.predict(worker, uncached_prompt_tokens, now)
    verdict = admit(AdmissionRequest(class_name=resolution.name, ...), estimate, config, load)
"""

from .admission import admit, may_preempt, retry_after_s
from .classes import PriorityClass, QosConfig, build_estimator, default_classes, resolve_class
from .degrade import plan_degradations
from .degrade_config import (
                             AdaptiveGenerationLimit,
                             CapMaxTokens,
                             DegradationConfig,
                             LocalPrefillForLowPriority,
)
from .estimator import EstimatorParams, LatencyEstimator, Rate
from .predictor import Calibration, LatencyPredictor
from .types import (
                    AdmissionRequest,
                    Backlog,
                    ClassResolution,
                    Degradation,
                    Estimate,
                    LoadSignals,
                    Verdict,
)

__all__ = [
    "AdaptiveGenerationLimit", "AdmissionRequest", "Backlog", "Calibration", "CapMaxTokens",
    "ClassResolution", "Degradation", "DegradationConfig", "Estimate", "EstimatorParams",
    "LatencyEstimator", "LatencyPredictor", "LoadSignals", "LocalPrefillForLowPriority", "PriorityClass",
    "QosConfig", "Rate", "Verdict", "admit", "build_estimator", "default_classes",
    "may_preempt", "plan_degradations", "resolve_class", "retry_after_s",
]
