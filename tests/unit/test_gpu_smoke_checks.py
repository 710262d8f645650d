"""The GPU smoke script's pure judgements, which run only on a GPU machine otherwise:
a disaggregated answer equals the aggregated one or first differs at a bf16 near-tie;
a refusal counts only as a 4xx naming the parameter."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import httpx
import openai
import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]


def _load():
    spec = importlib.util.spec_from_file_location("gpu_smoke", REPO / "scripts/gpu_smoke.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


smoke = _load()
TOKENS = [("The", -0.01, -5.0), (" capital", -0.2, -0.25), (" is", -0.01, -4.0),
          (" Paris", -0.02, -6.0)]
REFERENCE = "The capital is Paris"


@pytest.mark.parametrize(("other", "ok", "detail"), [
    ("The capital is Paris", True, "equal"),
    ("The city is big", True, "near-tie at token 1"),  # gap 0.05 <= 0.1
    ("The capital was", False, "differs at token 2"),   # gap 3.99
    ("A capital is Paris", False, "differs at token 0"),
    ("The capital is Paris, France", False, "past the reference's tokens"),
])
def test_a_difference_passes_only_at_a_near_tie(other, ok, detail):
    got_ok, got = smoke.same_or_near_tie(REFERENCE, TOKENS, other, tie=0.1)
    assert got_ok is ok and detail in got


def test_without_a_runner_up_a_difference_fails():
    assert smoke.same_or_near_tie("ab", [("ab", -0.1, None)], "ac", 0.1) == (
        False, "differs at token 0 (no runner-up)")


def _status(code: int, message: str) -> openai.APIStatusError:
    req = httpx.Request("POST", "http://127.0.0.1/v1/chat/completions")
    return openai.APIStatusError(message, response=httpx.Response(code, request=req),
                                 body=None)


def test_only_a_4xx_naming_the_parameter_is_a_refusal_by_name():
    assert smoke.refused_by_name(_status(400, "logprobs: the sglang decode engine "
                                              "cannot honour it"), "logprobs")
    assert not smoke.refused_by_name(_status(400, "bad request"), "logprobs")
    assert not smoke.refused_by_name(_status(503, "logprobs overloaded"), "logprobs")
    assert not smoke.refused_by_name(RuntimeError("logprobs"), "logprobs")
