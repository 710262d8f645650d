"""Worker process: `python -m splitserve.components.worker.main --config FILE`.

Dispatches on the section's ``engine``; every engine serves the same `generate`
protocol (Dynamo's engine request/response shape).
"""

from __future__ import annotations

from splitserve.serve.component import ComponentContext, run

from .engines import engine_choices


async def main(ctx: ComponentContext) -> None:
    engine = ctx.run.config.get("engine", "torch")
    cfg = ctx.config(engine_choices()[engine])
    if engine == "torch":
        from .torch_worker import run_torch_worker

        await run_torch_worker(ctx, cfg)
    elif engine == "mocker":
        from .mocker import run_mocker_worker

        await run_mocker_worker(ctx, cfg)
    elif engine == "vllm":
        from splitserve.components.engines.vllm.worker import run_vllm_worker

        await run_vllm_worker(ctx, cfg)
    elif engine in ("sglang", "trtllm"):
        from splitserve.components.engines import agg_worker

        await getattr(agg_worker, f"run_{engine}_worker")(ctx, cfg)
    else:  # pragma: no cover - the config model refuses other names
        raise ValueError(f"unknown engine {engine!r}")


if __name__ == "__main__":
    run(main)
