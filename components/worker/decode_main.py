"""DecodeWorker process: `python -m splitserve.components.worker.decode_main --config FILE`.

Every engine runs the same decode worker (``engine_processes.run_engine_decode_worker``:
the decode coordinator around the engine interface); the section's ``engine`` picks only
the config model and how the engine is brought up: ``torch`` (real model, KV pushed over
NIXL), ``mocker`` (Dynamo's simulated engines; never imports torch or NIXL), or an
in-process GPU engine (``vllm``, ``sglang``, ``trtllm``: the engine moves KV itself).
"""

from __future__ import annotations

from splitserve.serve.component import ComponentContext, run


def section_model(engine: str) -> type:
    """The DecodeWorker section model of ``engine``."""
    if engine == "mocker":
        # The mocker's own config module: a mocker fleet never imports torch or NIXL.
        from splitserve.components.mocker_worker.disagg_config import MockerDecodeWorkerConfig

        return MockerDecodeWorkerConfig
    if engine == "torch":
        from .disagg_config import DecodeWorkerConfig

        return DecodeWorkerConfig
    from .engine_processes import engine_decode_section

    return engine_decode_section(engine)


async def main(ctx: ComponentContext) -> None:
    from .engine_processes import run_engine_decode_worker

    engine = ctx.run.config.get("engine", "torch")
    await run_engine_decode_worker(ctx, ctx.config(section_model(engine)))


if __name__ == "__main__":
    run(main)
