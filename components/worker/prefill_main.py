"""PrefillWorker process: `python -m splitserve.components.worker.prefill_main --config FILE`.

Every engine runs the same prefill worker (``engine_processes.run_engine_prefill_worker``:
the prefill loop around the engine interface); the section's ``engine`` picks only the
config model and how the engine is brought up: ``torch`` (real model; writes KV into the
decode worker's blocks over NIXL), ``mocker`` (a simulated prefill engine), or an
in-process GPU engine (``vllm``, ``sglang``, ``trtllm``: the engine moves KV itself).
"""

from __future__ import annotations

from splitserve.serve.component import ComponentContext, run


def section_model(engine: str) -> type:
    """The PrefillWorker section model of ``engine``."""
    if engine == "mocker":
        # The mocker's own config module: a mocker fleet never imports torch or NIXL.
        from splitserve.components.mocker_worker.disagg_config import MockerPrefillWorkerConfig

        return MockerPrefillWorkerConfig
    if engine == "torch":
        from .disagg_config import PrefillWorkerConfig

        return PrefillWorkerConfig
    from .engine_processes import engine_prefill_section

    return engine_prefill_section(engine)


async def main(ctx: ComponentContext) -> None:
    from .engine_processes import run_engine_prefill_worker

    engine = ctx.run.config.get("engine", "torch")
    await run_engine_prefill_worker(ctx, ctx.config(section_model(engine)))


if __name__ == "__main__":
    run(main)
