"""Connectors: how the planner's actions reach the fleet.

``LocalConnector`` asks the `dynamo serve` supervisor's control endpoint,
``KubernetesConnector`` patches Deployment scales, ``DryRunConnector`` only logs.  All
take absolute replica targets from the actions, so applying an action twice is harmless.
"""

from .base import ApplyResult, Connector, DryRunConnector, ReplicaConnector, replica_steps
from .local import LocalConnector

__all__ = ["ApplyResult", "Connector", "DryRunConnector", "LocalConnector",
           "ReplicaConnector", "replica_steps"]
