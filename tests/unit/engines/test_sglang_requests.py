"""Every call the SGLang adapter makes, bound against the installed SGLang's signatures.

``sglang.Engine`` cannot be imported on a machine without its CUDA kernels, so the
signatures are read from the installed source (the same file the engine runs) and
bound with ``inspect.signature(...).bind``.
"""

from __future__ import annotations

import ast
import inspect

import pytest

from splitserve.contracts.engine import GenerateParams, SglangBootstrapHandoff
from splitserve.contracts.wire import FinishReason
from splitserve.components.engines.sglang.requests import (
    SglangPriority,
    generate_kwargs,
    new_bootstrap_room,
    sampling_params,
    to_delta,
)
from tests.unit.engines.upstream import sglang_module, sglang_source

pytestmark = pytest.mark.unit

P = GenerateParams(token_ids=(1, 2, 3), max_tokens=9, temperature=0.0, seed=4,
                   stop_token_ids=(2,), ignore_eos=False)
H = SglangBootstrapHandoff(bootstrap_host="127.0.0.1", bootstrap_port=8998,
                           bootstrap_room=new_bootstrap_room())


def installed_signature(rel: str, cls: str, method: str) -> inspect.Signature:
    """The signature of ``cls.method`` as written in the installed source file ``rel``
    (below ``sglang/``)."""
    src = sglang_source(rel)
    node = src.node(ast.ClassDef, cls)
    fn = next((n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
               and n.name == method), None)
    if fn is None:
        pytest.fail(f"{cls}.{method} is no longer in {src.label}", pytrace=False)
    args = fn.args
    for a in [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]:
        if a is not None:
            a.annotation = None
    args.defaults = [ast.Constant(None) for _ in args.defaults]
    args.kw_defaults = [None if d is None else ast.Constant(None) for d in args.kw_defaults]
    stub = ast.FunctionDef(name=method, args=args, body=[ast.Pass()], decorator_list=[],
                           returns=None, type_params=[])
    mod = ast.fix_missing_locations(ast.Module(body=[stub], type_ignores=[]))
    ns: dict = {}
    exec(compile(mod, src.label, "exec"), ns)  # noqa: S102 - a signature-only stub
    return inspect.signature(ns[method])


def test_async_generate_calls_bind_to_sglangs_engine():
    sig = installed_signature("srt/entrypoints/engine.py", "Engine", "async_generate")
    for kw in (generate_kwargs("r", P),
               generate_kwargs("r", P, max_new_tokens=1, handoff=H),
               generate_kwargs("r", P, handoff=H)):
        sig.bind(object(), **kw)
    with pytest.raises(TypeError):  # the check can fail: a misspelt keyword is caught
        sig.bind(object(), **{**generate_kwargs("r", P), "bootstrap_rooms": 1})


def test_abort_call_binds_to_sglangs_tokenizer_manager():
    sig = installed_signature("srt/managers/tokenizer_manager.py", "TokenizerManager",
                              "abort_request")
    sig.bind(object(), rid="r", abort_all=False)


def test_shutdown_binds():
    installed_signature("srt/entrypoints/engine.py", "Engine", "shutdown").bind(object())


def test_sampling_params_are_accepted_by_sglangs_sampling_params():
    SamplingParams = sglang_module("sglang.srt.sampling.sampling_params").SamplingParams

    sp = sampling_params(P, max_new_tokens=1)
    real = SamplingParams(**sp)
    assert real.max_new_tokens == 1 and set(real.stop_token_ids) == {2}
    assert real.sampling_seed == 4 and real.top_k == 1  # SGLang's greedy form of T=0
    assert "sampling_seed" not in sampling_params(GenerateParams(token_ids=(1,)))


def test_prefill_and_decode_share_the_triple():
    pre = generate_kwargs("r", P, max_new_tokens=1, handoff=H)
    dec = generate_kwargs("r", P, handoff=H)
    triple = ("bootstrap_host", "bootstrap_port", "bootstrap_room")
    assert [pre[k] for k in triple] == [dec[k] for k in triple]
    assert pre["sampling_params"]["max_new_tokens"] == 1
    assert dec["sampling_params"]["max_new_tokens"] == 9
    assert "bootstrap_room" not in generate_kwargs("r", P)


def test_rooms_are_distinct_and_fit_63_bits():
    rooms = {new_bootstrap_room() for _ in range(1000)}
    assert len(rooms) == 1000 and all(0 <= r < 2**63 for r in rooms)


@pytest.mark.parametrize(("fin", "finished", "reason"), [
    (None, False, None),
    ({"type": "stop", "matched": 2}, True, FinishReason.EOS),
    ({"type": "length", "length": 9}, True, FinishReason.LENGTH),
    ({"type": "abort", "message": "client gone"}, True, FinishReason.CANCELLED),
    ({"type": "abort", "status_code": 500, "message": "boom"}, True, FinishReason.ERROR),
    ({"type": "surprise"}, True, FinishReason.ERROR),
])
def test_outputs_become_deltas(fin, finished, reason):
    d = to_delta({"output_ids": [7, 8], "meta_info": {"finish_reason": fin,
                                                      "prompt_tokens": 3, "cached_tokens": 2}})
    assert d.token_ids == (7, 8) and d.finished is finished and d.finish_reason is reason
    assert (d.prompt_tokens, d.cached_tokens) == (3, 2)


PRIORITIES = {
    # case: (server args, level, SGLang's priority: None = not sent)
    "priority scheduling off: none sent": ({}, 0, None),
    "off explicitly": ({"enable_priority_scheduling": False}, 2, None),
    "on, higher first (SGLang's default): most important": (
        {"enable_priority_scheduling": True}, 0, 0),
    "on, higher first: level 1": ({"enable_priority_scheduling": True}, 1, -1),
    "on, higher first: batch at level 3": ({"enable_priority_scheduling": True}, 3, -3),
    "on, low values first: level 0": (
        {"enable_priority_scheduling": True, "schedule_low_priority_values_first": True}, 0, 0),
    "on, low values first: level 3": (
        {"enable_priority_scheduling": True, "schedule_low_priority_values_first": True}, 3, 3),
    "low-first alone does not turn it on": ({"schedule_low_priority_values_first": True}, 1,
                                            None),
}


@pytest.mark.parametrize(("server_args", "level", "sent"), PRIORITIES.values(),
                         ids=PRIORITIES.keys())
def test_the_level_goes_to_sglang_in_its_own_convention(server_args, level, sent):
    sig = installed_signature("srt/entrypoints/engine.py", "Engine", "async_generate")
    p = GenerateParams(token_ids=(1, 2, 3), max_tokens=9, priority=level)
    convention = SglangPriority.of(server_args)
    for kw in (generate_kwargs("r", p, priority=convention),
               generate_kwargs("r", p, max_new_tokens=1, handoff=H, priority=convention)):
        assert kw.get("priority") == sent and ("priority" in kw) == (sent is not None)
        sig.bind(object(), **kw)


def test_sglangs_priority_switches_and_direction_are_the_ones_read():
    """The server args the convention reads exist in the installed SGLang, with the
    direction this adapter assumes: higher values first unless low-first is set."""
    fields = sglang_source("srt/arg_groups/fields/schedule.py")
    fields.require("enable_priority_scheduling", "schedule_low_priority_values_first",
                   "abort_on_priority_when_disabled")
    assert "higher priority integer values will be scheduled first by default" in \
        fields.after("enable_priority_scheduling", 300)
    assert "lower priority integer values first" in \
        fields.after("schedule_low_priority_values_first", 300)
    scheduler = sglang_source("srt/managers/scheduler.py")
    scheduler.require("not self.enable_priority_scheduling",
                      "and self.abort_on_priority_when_disabled")
    from splitserve.components.engines.sglang.config import server_arg_names

    assert {"enable_priority_scheduling",
            "schedule_low_priority_values_first"} <= server_arg_names()
