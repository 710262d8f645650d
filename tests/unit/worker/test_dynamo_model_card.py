"""``dynamo_model_card``: an aggregated Worker's switch; a decode or prefill worker
refuses it by name (Dynamo's frontend sends whole requests, which only an aggregated
Worker serves)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from splitserve.components.engines.torch_cpu.sections import TorchWorkerConfig
from splitserve.contracts.sections import EngineDecodeSection, EnginePrefillSection

pytestmark = pytest.mark.unit


def test_an_aggregated_worker_takes_it():
    assert TorchWorkerConfig(dynamo_model_card=True).dynamo_model_card is True
    assert TorchWorkerConfig().dynamo_model_card is False


@pytest.mark.parametrize("section", [EngineDecodeSection, EnginePrefillSection])
def test_decode_and_prefill_workers_refuse_it(section):
    with pytest.raises(ValidationError, match="dynamo_model_card: aggregated Workers only"):
        section(dynamo_model_card=True)
    assert section().dynamo_model_card is False
