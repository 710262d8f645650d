"""DecodeWorker process: `python -m splitserve.components.worker.decode_main --config FILE`.

Dispatches on the section's ``engine``: ``torch`` (real model, KV over NIXL),
``mocker`` (Dynamo's simulated engines behind the same decider and prefill queue), or
``sglang`` / ``trtllm`` (the engine moves KV itself; the interface-driven coordinator).
"""

from __future__ import annotations

from splitserve.serve.component import ComponentContext, run


async def main(ctx: ComponentContext) -> None:
    engine = ctx.run.config.get("engine", "torch")
    if engine in ("sglang", "trtllm"):
        # Engines that move KV themselves: the interface-driven decode coordinator.
        from .engine_processes import engine_decode_section, run_engine_decode_worker

        await run_engine_decode_worker(ctx, ctx.config(engine_decode_section(engine)))
    elif engine == "mocker":
        # The mocker's own config module: a mocker fleet never imports torch or NIXL.
        from splitserve.components.mocker_worker.disagg_config import MockerDecodeWorkerConfig
        from splitserve.components.mocker_worker.disagg_decode import run_mocker_decode_worker

        await run_mocker_decode_worker(ctx, ctx.config(MockerDecodeWorkerConfig))
    else:
        from .decode_worker import run_decode_worker
        from .disagg_config import DecodeWorkerConfig

        await run_decode_worker(ctx, ctx.config(DecodeWorkerConfig))


if __name__ == "__main__":
    run(main)
