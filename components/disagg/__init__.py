"""The disaggregated router: decides, per request, whether prefill runs on the prefill pool.

Pure deciders built by name from the ``disaggregated_router`` policy section; the decode
worker calls ``DisaggregatedRouter.decide(request, snapshot)`` and acts on the answer.
"""

from .affinity import AffinityChoice, PrefillAffinity, block_hashes, read_share, share_message
from .config import (
                     DisaggregatedRouter,
                     build_decider,
                     load_disaggregated_router_file,
                     parse_disaggregated_router,
)
from .forced import ForcedDecider
from .registry import DeciderRegistry, DeciderType, default_decider_registry
from .score import Rule, ScoreDecider
from .threshold import ThresholdDecider, should_offload_prefill, threshold_rule
from .types import Decider, OffloadDecision, OffloadRequest, OffloadSnapshot

__all__ = [
    "AffinityChoice", "Decider", "DeciderRegistry", "DeciderType", "DisaggregatedRouter",
    "ForcedDecider", "PrefillAffinity", "block_hashes", "read_share", "share_message",
    "OffloadDecision", "OffloadRequest", "OffloadSnapshot", "Rule", "ScoreDecider",
    "ThresholdDecider", "build_decider", "default_decider_registry",
    "load_disaggregated_router_file", "parse_disaggregated_router",
    "should_offload_prefill", "threshold_rule",
]
