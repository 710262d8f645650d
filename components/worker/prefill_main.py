"""PrefillWorker process: `python -m splitserve.components.worker.prefill_main --config FILE`.

Dispatches on the section's ``engine``: ``torch`` (real model, KV over NIXL),
``mocker`` (a simulated prefill engine; results handed to decode workers over NATS), or
``sglang`` / ``trtllm`` (the engine moves KV itself; the interface-driven prefill loop).
"""

from __future__ import annotations

from splitserve.serve.component import ComponentContext, run


async def main(ctx: ComponentContext) -> None:
    engine = ctx.run.config.get("engine", "torch")
    if engine in ("sglang", "trtllm"):
        # Engines that move KV themselves: the interface-driven prefill loop.
        from .engine_processes import engine_prefill_section, run_engine_prefill_worker

        await run_engine_prefill_worker(ctx, ctx.config(engine_prefill_section(engine)))
    elif engine == "mocker":
        # The mocker's own config module: a mocker fleet never imports torch or NIXL.
        from splitserve.components.mocker_worker.disagg_config import MockerPrefillWorkerConfig
        from splitserve.components.mocker_worker.disagg_prefill import run_mocker_prefill_worker

        await run_mocker_prefill_worker(ctx, ctx.config(MockerPrefillWorkerConfig))
    else:
        from .disagg_config import PrefillWorkerConfig
        from .prefill_worker import run_prefill_worker

        await run_prefill_worker(ctx, ctx.config(PrefillWorkerConfig))


if __name__ == "__main__":
    run(main)
