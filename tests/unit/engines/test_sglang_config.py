"""The SGLang config maps onto the installed SGLang's real ServerArgs and its flags."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from splitserve.components.engines.sglang.config import (
    SglangEngineArgs,
    check_server_args,
    server_args_kwargs,
    to_cli_args,
)
from splitserve.components.engines.sglang.sections import (
    SglangDecodeWorkerConfig,
    SglangPrefillWorkerConfig,
)
from tests.unit.engines.upstream import needs_sglang_module

pytestmark = pytest.mark.unit

_sglang_installed = needs_sglang_module("sglang.srt.server_args")

EP = "tcp://127.0.0.1:5557"
MODEL = "/models/Llama-3.1-8B-Instruct"


def filled(args: SglangEngineArgs) -> SglangEngineArgs:
    """``args`` with the model's directory, as the registry's factory (``make_engine``)
    fills it in from Common.model."""
    return args.model_copy(update={"model_path": MODEL})


@pytest.mark.parametrize(("role", "mode"), [("agg", "null"), ("prefill", "prefill"),
                                            ("decode", "decode")])
def test_each_role_builds_the_real_server_args(role, mode):
    from sglang.srt.server_args import ServerArgs

    args = filled(SglangEngineArgs(tp_size=2, page_size=32, mem_fraction_static=0.7))
    sa = check_server_args(server_args_kwargs(args, role, "llama", EP))
    assert isinstance(sa, ServerArgs)
    assert (sa.model_path, sa.served_model_name) == (MODEL, "llama")
    assert (sa.disaggregation_mode, sa.tp_size, sa.page_size) == (mode, 2, 32)
    # structured output (on by default) needs SGLang's tokenizer for its grammar backend
    assert sa.mem_fraction_static == 0.7 and not sa.skip_tokenizer_init
    assert sa.incremental_streaming_output and sa.host == "127.0.0.1"
    assert '"endpoint": "tcp://127.0.0.1:5557"' in sa.kv_events_config
    if role == "prefill":
        assert sa.disaggregation_bootstrap_port == 8998
    if role != "agg":
        assert sa.disaggregation_transfer_backend == "nixl"
    # the same keywords construct ServerArgs directly (what sglang.Engine(**kw) does)
    direct = ServerArgs(**server_args_kwargs(args, role, "llama", EP))
    assert direct.disaggregation_mode == mode


def test_cli_flags_are_sglangs_own():
    # structured output off: SGLang runs without its tokenizer, a flag of its own
    argv = to_cli_args(server_args_kwargs(filled(SglangEngineArgs(structured_output=False)),
                                          "prefill", "m", EP))
    for flag in ("--model-path", "--disaggregation-mode", "--disaggregation-bootstrap-port",
                 "--kv-events-config", "--skip-tokenizer-init", "--page-size"):
        assert flag in argv


def test_extra_server_args_are_checked_by_sglang():
    ok = SglangEngineArgs(extra_server_args={"schedule_policy": "lpm"})
    assert server_args_kwargs(ok, "agg", "m")["schedule_policy"] == "lpm"
    with pytest.raises(ValidationError, match=r"extra_server_args\.bogus_field"):
        SglangEngineArgs(extra_server_args={"bogus_field": 1})
    with pytest.raises(ValidationError, match="schedule_policy: SGLang refused 'fifo'"):
        SglangEngineArgs(extra_server_args={"schedule_policy": "fifo"})
    with pytest.raises(ValidationError, match=r"extra_server_args\.page_size: set by its own"):
        SglangEngineArgs(extra_server_args={"page_size": 8})


def test_own_fields_are_strict():
    with pytest.raises(ValidationError):
        SglangEngineArgs(transfer_backend="tcp")
    with pytest.raises(ValidationError):
        SglangEngineArgs(unknown=1)
    with pytest.raises(ValueError, match="loopback"):
        server_args_kwargs(SglangEngineArgs(), "agg", "m", "tcp://0.0.0.0:1")


def test_disaggregated_sections_validate_the_offload_policy():
    # The offload policy is checked by the decider plugins when a graph's config is
    # loaded (the catalog's DecodeWorker model), not by the engine's section alone.
    from splitserve.serve.catalog import DecodeWorker

    SglangDecodeWorkerConfig(disaggregated_router={"enable": True})
    DecodeWorker.config_model.model_validate(
        {"engine": "sglang", "disaggregated_router": {"enable": True}})
    with pytest.raises(ValidationError):
        DecodeWorker.config_model.model_validate(
            {"engine": "sglang", "disaggregated_router": {"enable": True, "bogus": 1}})
    assert SglangDecodeWorkerConfig().local_prefill_engine is False
    assert SglangPrefillWorkerConfig().engine_args.bootstrap_port == 8998


def test_a_second_engine_in_the_decode_workers_process_is_refused():
    # SGLang keeps one live config per process; Engine.shutdown kills every child.
    for frac in (0.85, 0.45):
        with pytest.raises(ValidationError, match="one engine per process"):
            SglangDecodeWorkerConfig(local_prefill_engine=True,
                                     engine_args={"mem_fraction_static": frac})


def test_without_structured_output_sglang_runs_on_token_ids_alone():
    args = SglangEngineArgs(structured_output=False)
    assert server_args_kwargs(args, "agg", "llama", EP)["skip_tokenizer_init"] is True
