"""Every registered engine implements every member the ``Engine`` protocol declares (the
shells call them without probing), and in each role claims only the optional abilities
its class implements; each declares the request parameters it honours with the
contract's type."""

from __future__ import annotations

import pytest

from splitserve.components.worker import registry
from splitserve.contracts.engine import (
    ENGINE_PARAMS,
    AbilityAbsent,
    EngineCapabilities,
    EngineRequestParams,
    GenerateParams,
    protocol_members,
)
from tests.unit.worker.engine_conformance import ability_problems, class_problems

pytestmark = pytest.mark.unit

ROLES = ("agg", "decode", "prefill")


def _torch(role):
    from splitserve.components.engines.torch_cpu.adapter import TorchEngine

    # core and runner are only used by requests; an agent makes live KV moves possible
    return TorchEngine(None, None, 16, agent=object(), kv_moves=role == "agg")


def _mocker(role):
    from splitserve.components.engines.mocker.adapter import MockerEngine

    children = {"agg": ("local",), "decode": ("local", "decode"), "prefill": ("prefill",)}
    return MockerEngine({c: None for c in children[role]}, "m", 16, 1024, 5.0)


def _vllm(role):
    from splitserve.components.engines.vllm.config import VllmEngineArgs, VllmKvTransfer
    from splitserve.components.engines.vllm.engine import VllmEngine

    return VllmEngine(VllmEngineArgs(), "m", role,
                      None if role == "agg" else VllmKvTransfer())


def _sglang(role):
    from splitserve.components.engines.sglang.config import SglangEngineArgs
    from splitserve.components.engines.sglang.engine import SglangEngine

    return SglangEngine(SglangEngineArgs(), "m", role)


def _trtllm(role):
    from splitserve.components.engines.trtllm.config import TrtllmEngineArgs
    from splitserve.components.engines.trtllm.engine import TrtllmEngine

    return TrtllmEngine(TrtllmEngineArgs(), "m", role, machine_id=1)


BUILD = {"torch": _torch, "mocker": _mocker, "vllm": _vllm, "sglang": _sglang,
         "trtllm": _trtllm}
"""One engine object per registered engine and role, not started (no model, no library)."""


def test_every_registered_engine_has_a_builder_here():
    assert set(BUILD) == set(registry.ENGINES)


@pytest.mark.parametrize("name", sorted(registry.ENGINES))
def test_the_registered_class_has_every_member_the_protocol_declares(name):
    cls = registry.engine_class(name)
    assert class_problems(cls) == [], f"{name} ({cls.__qualname__})"


@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("name", sorted(registry.ENGINES))
def test_each_role_claims_only_abilities_its_class_implements(name, role):
    eng = BUILD[name](role)
    assert isinstance(eng, registry.engine_class(name))
    assert isinstance(eng.info.capabilities, EngineCapabilities)
    assert eng.info.name == name
    assert ability_problems(eng) == []


@pytest.mark.parametrize("name", sorted(registry.ENGINES))
def test_each_engine_declares_its_request_parameters(name):
    declared = registry.request_params(name)
    assert isinstance(declared, EngineRequestParams)
    assert declared.honoured <= set(ENGINE_PARAMS)


def test_a_class_missing_a_member_is_named():
    class Partial:
        info: object

        async def start(self) -> None: ...

        def generate(self, request_id, params): ...

        async def prefill(self, request_id, params): ...  # no destination

    problems = class_problems(Partial)
    assert "prefill: no parameter destination" in problems
    assert "validate: missing" in problems and "park: missing" in problems
    assert "info: not declared on the class (info: EngineInfo)" not in problems
    assert len(protocol_members()) >= 20


@pytest.mark.asyncio
async def test_an_absent_ability_raises_naming_the_engine_and_the_flag():
    eng = _mocker("agg")
    with pytest.raises(AbilityAbsent, match=r"mocker engine has no park\(\) "
                       r"\(capabilities.moves_kv is false\)"):
        await eng.park("r")
    with pytest.raises(AbilityAbsent, match="prefix_lookup"):
        await eng.cached_prefix_tokens((1, 2))
    eng.validate(GenerateParams(token_ids=(1,)))  # every engine has validate
