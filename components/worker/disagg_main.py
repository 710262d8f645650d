"""The DecodeWorker and PrefillWorker process mains (``decode_main``, ``prefill_main``).

Every engine runs the same decode worker and prefill worker (``engine_processes``: the
decode coordinator and the prefill loop around the engine interface); the section's
``engine`` picks only the config model and how the engine is brought up: ``torch``
(real model, KV pushed over NIXL), ``mocker`` (Dynamo's simulated engines; never imports
torch or NIXL), or an in-process GPU engine (``vllm``, ``sglang``, ``trtllm``: the engine
moves KV itself).
"""

from __future__ import annotations

from typing import Literal

from splitserve.serve.component import ComponentContext

Role = Literal["decode", "prefill"]


def section_model(engine: str, role: Role) -> type:
    """The DecodeWorker / PrefillWorker section model of ``engine``."""
    if engine == "mocker":
        # The mocker's own config module: a mocker fleet never imports torch or NIXL.
        from splitserve.components.mocker_worker import disagg_config as mocker

        return (mocker.MockerDecodeWorkerConfig if role == "decode"
                else mocker.MockerPrefillWorkerConfig)
    if engine == "torch":
        from . import disagg_config as torch_sections

        return (torch_sections.DecodeWorkerConfig if role == "decode"
                else torch_sections.PrefillWorkerConfig)
    from .engine_processes import engine_decode_section, engine_prefill_section

    return (engine_decode_section if role == "decode" else engine_prefill_section)(engine)


async def run_role(ctx: ComponentContext, role: Role) -> None:
    """Component main of a DecodeWorker (``role="decode"``) or PrefillWorker."""
    from .engine_processes import run_engine_decode_worker, run_engine_prefill_worker

    cfg = ctx.config(section_model(ctx.run.config.get("engine", "torch"), role))
    if role == "decode":
        await run_engine_decode_worker(ctx, cfg)
    else:
        await run_engine_prefill_worker(ctx, cfg)
