"""KV transfer over NIXL: prefill workers write a prompt's KV into decode workers' blocks.

Pure parts (no NIXL, no etcd): ``config``, ``descriptors``, ``layout``, ``messages``,
``staging``, ``payload``, ``inbox``.  Adapters: ``nixl_port`` (NIXL), ``directory``
(etcd), and ``agent``, which ties them together.  Importing this package does not import
NIXL; creating an agent does.
"""

from splitserve.contracts.kit.lazy import lazy_exports

# Imported on first use: config sections import ``config`` from this package in every
# process that validates a config, and ``agent`` (through the layout kernels) imports
# torch.
__getattr__ = lazy_exports(__name__, globals(), {
    ".agent": ("KvTransferAgent", "WriteResult"),
    ".config": ("KvTransferConfig",),
    ".descriptors": ("BlockRun", "merge_runs", "run_descs", "staged_runs"),
    ".directory": ("AgentDirectory", "MetadataCache"),
    ".errors": ("LayoutMismatch", "PeerNotFound", "StagingFull", "TransferError",
                "TransferTimeout"),
    ".inbox": ("Arrival",),
    ".layout": ("PoolLayout", "TransformPlan", "needed_src_ranks", "plan_transform",
                "same_layout"),
    ".messages": ("AgentRecord", "agent_key"),
})

__all__ = [
    "AgentDirectory", "AgentRecord", "Arrival", "BlockRun", "KvTransferAgent",
    "KvTransferConfig", "LayoutMismatch", "MetadataCache", "PeerNotFound", "PoolLayout",
    "StagingFull", "TransferError", "TransferTimeout", "TransformPlan", "WriteResult",
    "agent_key", "merge_runs", "needed_src_ranks", "plan_transform", "run_descs",
    "same_layout", "staged_runs",
]
