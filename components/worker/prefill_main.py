"""PrefillWorker process: `python -m splitserve.components.worker.prefill_main --config FILE`."""

from __future__ import annotations

from splitserve.serve.component import ComponentContext, run

from .disagg_config import PrefillWorkerConfig


async def main(ctx: ComponentContext) -> None:
    from .prefill_worker import run_prefill_worker

    await run_prefill_worker(ctx, ctx.config(PrefillWorkerConfig))


if __name__ == "__main__":
    run(main)
