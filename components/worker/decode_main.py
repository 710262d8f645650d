"""DecodeWorker process: `python -m splitserve.components.worker.decode_main --config FILE`
(one process for every engine: the decode shell, ``decode.py``)."""

from __future__ import annotations

from splitserve.serve.component import ComponentContext, run

from . import registry


async def main(ctx: ComponentContext) -> None:
    from .decode import run_decode

    cfg = ctx.config(registry.section(registry.engine_of(ctx.run.config), "decode"))
    await run_decode(ctx, cfg)


if __name__ == "__main__":
    run(main)
