"""KV transfer over NIXL: prefill workers write a prompt's KV into decode workers' blocks.

Pure parts (no NIXL, no etcd): ``config``, ``descriptors``, ``layout``, ``messages``,
``staging``, ``payload``, ``inbox``.  Adapters: ``nixl_port`` (NIXL), ``directory``
(etcd), and ``agent``, which ties them together.  Importing this package does not import
NIXL; creating an agent does.
"""

from .agent import KvTransferAgent, WriteResult
from .config import KvTransferConfig
from .descriptors import BlockRun, merge_runs, run_descs, staged_runs
from .directory import AgentDirectory, MetadataCache
from .errors import LayoutMismatch, PeerNotFound, StagingFull, TransferError, TransferTimeout
from .inbox import Arrival
from .layout import PoolLayout, TransformPlan, needed_src_ranks, plan_transform, same_layout
from .messages import AgentRecord, agent_key

__all__ = [
    "AgentDirectory", "AgentRecord", "Arrival", "BlockRun", "KvTransferAgent",
    "KvTransferConfig", "LayoutMismatch", "MetadataCache", "PeerNotFound", "PoolLayout",
    "StagingFull", "TransferError", "TransferTimeout", "TransformPlan", "WriteResult",
    "agent_key", "merge_runs", "needed_src_ranks", "plan_transform", "run_descs",
    "same_layout", "staged_runs",
]
