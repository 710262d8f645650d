"""DecodeWorker process: `python -m splitserve.components.worker.decode_main --config FILE`."""

from __future__ import annotations

from splitserve.serve.component import ComponentContext, run

from .disagg_config import DecodeWorkerConfig


async def main(ctx: ComponentContext) -> None:
    from .decode_worker import run_decode_worker

    await run_decode_worker(ctx, ctx.config(DecodeWorkerConfig))


if __name__ == "__main__":
    run(main)
