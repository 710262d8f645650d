"""Every engine's sections resolve through the registry for every role, and each
worker main runs its role's shell with the engine's section."""

from __future__ import annotations

import asyncio
import importlib
from types import SimpleNamespace

import pytest

from splitserve.components.worker import registry

pytestmark = pytest.mark.unit

PREFIX = {"sglang": "Sglang", "trtllm": "Trtllm", "torch": "Torch", "mocker": "Mocker",
          "vllm": "Vllm"}
MAINS = {"agg": "main", "decode": "decode_main", "prefill": "prefill_main"}


@pytest.mark.parametrize("engine", sorted(registry.ENGINES))
@pytest.mark.parametrize("role", sorted(MAINS))
def test_worker_mains_run_the_role_shell_with_the_engines_section(monkeypatch, engine, role):
    from splitserve.components.worker.entry import SHELLS

    shell_name, runner = SHELLS[role]
    main = importlib.import_module(f"splitserve.components.worker.{MAINS[role]}")
    shell = importlib.import_module(f"splitserve.components.worker.{shell_name}")
    seen = []

    async def fake_run(ctx, cfg):
        seen.append(type(cfg).__name__)

    monkeypatch.setattr(shell, runner, fake_run)
    raw = {"engine": engine}
    ctx = SimpleNamespace(run=SimpleNamespace(config=raw),
                          config=lambda model: model.model_validate(raw))
    asyncio.run(main.main(ctx))
    assert len(seen) == 1 and seen[0].startswith(PREFIX[engine])


def test_every_registered_reference_resolves():
    for name, entry in registry.ENGINES.items():
        for ref in (entry.sections, entry.host, entry.factory, entry.serves_agg):
            if ref is not None:
                assert registry.resolve(ref) is not None, (name, ref)
        assert set(registry.resolve(entry.sections).SECTIONS) == {"agg", "decode", "prefill"}


def test_an_unknown_engine_is_named_in_the_error():
    with pytest.raises(ValueError, match="unknown engine 'nope'"):
        registry.spec("nope")


def test_a_decode_sections_unknown_decider_is_a_config_error_with_its_path():
    from pydantic import ValidationError

    from splitserve.serve.catalog import DecodeWorker

    with pytest.raises(ValidationError) as caught:
        DecodeWorker.config_model.model_validate({"disaggregated_router": {"decider": "no"}})
    (err,) = caught.value.errors()
    assert err["loc"] == ("disaggregated_router", "decider")
    assert "unknown decider 'no'" in err["msg"]
