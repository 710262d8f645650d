"""Hot reload inside a component process: start a PolicyWatcher with the component's apply
function.  Called once by components that follow policy versions (router, decode worker).
"""

from __future__ import annotations

import logging
import os

from .signing import PolicyKey
from .store import PolicyStore
from .watch import ApplyFn, PolicyWatcher

log = logging.getLogger("splitserve.components.policy")


async def follow_policy(namespace: str, component: str, instance: str,
                        apply_fn: ApplyFn) -> PolicyWatcher:
    """Apply the stored current policy (if any) now and every new version later.

    The config file's settings stay in force until a version is applied with
    `dynamo policy apply`; a version the component cannot apply is refused, the
    previous settings keep running, and the refusal is published for `dynamo policy show`.
    """
    key_file = os.environ.get("SPLITSERVE_POLICY_KEY_FILE")
    key = None
    if key_file:
        try:
            key = PolicyKey.from_file(key_file)
        except (OSError, ValueError) as exc:  # every version is then refused, and reported
            log.error("%s: cannot read the policy key %s: %s", component, key_file, exc)
    else:
        log.warning("%s: no SPLITSERVE_POLICY_KEY_FILE; every policy version is refused",
                    component)
    store = PolicyStore(os.environ["ETCD_ENDPOINTS"], namespace, signing_key=key)

    def on_status(version: int, ok: bool, reason: str) -> None:
        if ok:
            log.info("%s: policy version %d applied", component, version)
        else:
            log.warning("%s: policy version %d refused: %s", component, version, reason)

    watcher = PolicyWatcher(store, apply_fn, on_status, component=component, instance=instance)
    await watcher.start()
    return watcher
