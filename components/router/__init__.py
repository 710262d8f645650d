"""KV-aware router core: filters -> weighted scorers -> picker, built from YAML.

Pure: the router process feeds it a ``Snapshot`` per request and gets a ``Decision`` back.
"""

from .config import (
                     PluginRef,
                     PluginSpec,
                     RouterConfig,
                     SchedulingProfileSpec,
                     check_router_config,
                     load_router_config_file,
                     parse_router_config,
)
from .core import (
                     NamedFilter,
                     NamedPicker,
                     Router,
                     SchedulingProfile,
                     WeightedScorer,
                     build_router,
                     clamp_score,
)
from .explain import decision_table, format_decision, worker_label
from .protocols import Filter, FilterResult, Picker, PluginKind, Scorer
from .registry import PluginRegistry, PluginType, default_registry
from .tracker import RecentPrefixTracker
from .types import (
                     Decision,
                     FilterRemoval,
                     RouteRequest,
                     ScorerBreakdown,
                     Snapshot,
                     WorkerId,
                     WorkerState,
)

__all__ = [
    "Decision", "Filter", "FilterRemoval", "FilterResult", "NamedFilter", "NamedPicker",
    "Picker", "PluginKind", "PluginRef", "PluginRegistry", "PluginSpec", "PluginType",
    "RecentPrefixTracker", "RouteRequest", "Router", "RouterConfig", "SchedulingProfile",
    "SchedulingProfileSpec", "Scorer", "ScorerBreakdown", "Snapshot", "WeightedScorer",
    "WorkerId", "WorkerState", "build_router", "check_router_config", "clamp_score",
    "decision_table", "default_registry", "format_decision", "load_router_config_file",
    "parse_router_config", "worker_label",
]
