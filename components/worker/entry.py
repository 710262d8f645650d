"""The component main of each worker role: read the section's ``engine``, validate the
section with that engine's model from the registry, run the role's shell.  The process
entry points (``main``, ``decode_main``, ``prefill_main``) are one line each."""

from __future__ import annotations

import importlib
from collections.abc import Awaitable, Callable

from splitserve.contracts.kit.component import ComponentContext

from . import registry
from splitserve.contracts.kit.hosting import Role

SHELLS: dict[str, tuple[str, str]] = {"agg": ("agg", "run_aggregated"),
                                      "decode": ("decode", "run_decode"),
                                      "prefill": ("prefill", "run_prefill")}
"""Role -> (shell module in this package, its component main)."""


def role_main(role: Role) -> Callable[[ComponentContext], Awaitable[None]]:
    """The component main of ``role``; the shell is imported when it runs."""

    async def main(ctx: ComponentContext) -> None:
        module, name = SHELLS[role]
        shell = importlib.import_module(f"{__package__}.{module}")
        cfg = ctx.config(registry.section(registry.engine_of(ctx.run.config), role))
        await getattr(shell, name)(ctx, cfg)

    return main
