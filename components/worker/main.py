"""Worker process: `python -m splitserve.components.worker.main --config FILE`.

The section's ``engine`` picks its config model from the registry; every engine runs the
one aggregated shell (``agg.py``) and serves the same `generate` protocol (Dynamo's
engine request/response shape).
"""

from __future__ import annotations

from splitserve.serve.component import ComponentContext, run

from . import registry


async def main(ctx: ComponentContext) -> None:
    from .agg import run_aggregated

    cfg = ctx.config(registry.section(registry.engine_of(ctx.run.config), "agg"))
    await run_aggregated(ctx, cfg)


if __name__ == "__main__":
    run(main)
