"""Planner process: `python -m splitserve.planner.main --config FILE`.

Every interval: observe the graph (its replicas' Prometheus metrics through the local
supervisor, and the JetStream prefill-queue depth), run the pure core, and apply the
changes through the connector.  Follows `autoscale` updates of the live policy.
"""

from __future__ import annotations

import logging
import os

from splitserve.contracts.kit.component import ComponentContext, run

from .component_config import PlannerComponentConfig
from .config import load_planner_policy, parse_planner_policy
from .connectors.base import DryRunConnector
from .connectors.local import LocalConnector
from .loop import Planner
from .metrics import PlannerMetrics
from .sources import MetricsSource

log = logging.getLogger("splitserve.planner")


def _connector(cfg: PlannerComponentConfig, control_url: str, token: str | None):
    if cfg.connector == "local":
        return LocalConnector(control_url, cfg.components, token=token)
    if cfg.connector == "kubernetes":
        from .connectors.kubernetes import KubernetesConnector

        return KubernetesConnector.from_environment(cfg.kubernetes_namespace)
    return DryRunConnector()


async def main(ctx: ComponentContext) -> None:
    cfg = ctx.config(PlannerComponentConfig)
    policy = (parse_planner_policy(cfg.policy, "Planner.policy") if isinstance(cfg.policy, dict)
              else load_planner_policy(cfg.policy))
    control_url = os.environ["SPLITSERVE_CONTROL_URL"]
    from splitserve.contracts.kit.credentials import read_secret

    token = read_secret(os.environ["SPLITSERVE_CONTROL_TOKEN_FILE"])
    from splitserve.components.prefill_queue import PrefillQueue

    queue = await PrefillQueue.connect(os.environ["NATS_SERVER"], ctx.namespace,
                                       ctx.run.common.served_model_name, cfg.prefill_queue,
                                       client_name="planner")
    depth = queue.depth_monitor()
    await depth.start()
    several = bool(ctx.run.pool or ctx.run.pools)  # the frontend serves several models
    source = MetricsSource(control_url, components=cfg.components,
                           queue_depth=lambda: depth.depth, control_token=token,
                           model=ctx.run.common.served_model_name if several else None)
    metrics = PlannerMetrics()
    ctx.serve_metrics(metrics.registry)
    planner = Planner(policy, source, _connector(cfg, control_url, token), metrics)

    def apply_policy(doc, version: int) -> None:
        if doc.autoscale is not None:
            planner.set_policy(planner.policy.model_copy(update={"autoscale": doc.autoscale}))

    from splitserve.components.policy.component import follow_policy

    watcher = await follow_policy(ctx.namespace, "Planner", f"{os.getpid():x}", apply_policy)
    ctx.report("ready", detail=f"{cfg.connector} connector, every "
                               f"{policy.planner.interval_s:g}s")
    try:
        await planner.run(ctx.stopping)
    finally:
        await watcher.stop()
        await depth.stop()
        await queue.close()
        await planner.connector.close()
        await source.close()


if __name__ == "__main__":
    run(main)
