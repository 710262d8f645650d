"""Hot reload inside a component process: start a PolicyWatcher with the component's apply
function.  Called once by components that follow policy versions (router, decode worker).
"""

from __future__ import annotations

import logging
import os

from .store import PolicyStore
from .watch import ApplyFn, PolicyWatcher

log = logging.getLogger("splitserve.policy")


async def follow_policy(namespace: str, component: str, instance: str,
                        apply_fn: ApplyFn) -> PolicyWatcher:
    """Apply the stored current policy (if any) now and every new version later.

    The config file's settings stay in force until a version is applied with
    `dynamo policy apply`; a version the component cannot apply is refused, the
    previous settings keep running, and the refusal is published for `dynamo policy show`.
    """
    store = PolicyStore(os.environ["ETCD_ENDPOINTS"], namespace)

    def on_status(version: int, ok: bool, reason: str) -> None:
        if ok:
            log.info("%s: policy version %d applied", component, version)
        else:
            log.warning("%s: policy version %d refused: %s", component, version, reason)

    watcher = PolicyWatcher(store, apply_fn, on_status, component=component, instance=instance)
    await watcher.start()
    return watcher
