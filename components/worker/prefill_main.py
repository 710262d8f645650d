"""PrefillWorker process: `python -m splitserve.components.worker.prefill_main --config FILE`
(one process for every engine: the prefill shell, ``prefill.py``)."""

from __future__ import annotations

from splitserve.serve.component import ComponentContext, run

from . import registry


async def main(ctx: ComponentContext) -> None:
    from .prefill import run_prefill

    cfg = ctx.config(registry.section(registry.engine_of(ctx.run.config), "prefill"))
    await run_prefill(ctx, cfg)


if __name__ == "__main__":
    run(main)
