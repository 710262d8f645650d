"""PrefillWorker process: `python -m splitserve.components.worker.prefill_main --config FILE`
(one process for every engine; see ``disagg_main``)."""

from __future__ import annotations

from splitserve.serve.component import run

from .disagg_main import run_role


async def main(ctx) -> None:
    await run_role(ctx, "prefill")


if __name__ == "__main__":
    run(main)
