"""KV offload tiers of the vLLM, SGLang and TensorRT-LLM configs: each field lands in the
engine's own argument, checked with the engine's own parser where it is installed, and
what an engine cannot do is refused naming the field.

Nothing here starts an engine: vLLM's config objects are built, SGLang's ``ServerArgs``
and its CPU-only resolution steps run, and TensorRT-LLM (not installable here) is
checked by the shape of the keywords this project hands to ``LLM``.
"""

from __future__ import annotations

import json
import os

import pytest
from pydantic import ValidationError

from splitserve.components.engines.sglang.config import (
    SglangEngineArgs,
    check_server_args,
    decode_problems,
    server_args_kwargs,
    to_cli_args,
)
from splitserve.components.engines.trtllm.config import TrtllmEngineArgs, llm_kwargs
from splitserve.components.engines.vllm.config import (
    SELF_DESCRIBING,
    MAPPED,
    VllmEngineArgs,
    disaggregated_problems,
    to_engine_args,
)
from tests.installed import needs_vllm
from tests.unit.engines.upstream import sglang_module, sglang_source

pytestmark = pytest.mark.unit

GIB = 1 << 30
EP = "tcp://127.0.0.1:5557"
NIXL = {"kv_connector": "NixlConnector", "kv_role": "kv_consumer", "kv_buffer_device": "cpu"}


# --- vLLM --------------------------------------------------------------------------


def offloading(**kw) -> VllmEngineArgs:
    """A vLLM config offloading 2.5 GiB (KV events off unless a test turns them on: most
    build vLLM's config without an event endpoint)."""
    return VllmEngineArgs(**{"kv_offloading_gib": 2.5, "kv_events": False, **kw})


@pytest.fixture
def restored_environ():
    """vLLM's CPU platform sets process environment variables while it builds a config;
    put the environment back afterwards so that later tests see the one they expect."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@needs_vllm
@pytest.mark.parametrize("backend", ["native", "lmcache"])
def test_vllm_offloading_lands_where_vllms_own_parser_puts_it(backend):
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    ours = to_engine_args(offloading(kv_offloading_backend=backend), "/m", "served")
    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    ns = parser.parse_args(["--model", "/m", "--kv-offloading-size", "2.5",
                            "--kv-offloading-backend", backend])
    theirs = AsyncEngineArgs.from_cli_args(ns)
    assert (ours.kv_offloading_size, ours.kv_offloading_backend) == (2.5, backend)
    assert (theirs.kv_offloading_size, theirs.kv_offloading_backend) == (2.5, backend)


@needs_vllm
def test_vllm_offloading_off_leaves_vllms_defaults():
    ea = to_engine_args(VllmEngineArgs(), "/m", "served")
    assert ea.kv_offloading_size is None and ea.kv_offloading_backend == "native"
    assert {"kv_offloading_size", "kv_offloading_backend"} <= MAPPED
    with pytest.raises(ValidationError, match="kv_offloading_size.*own field"):
        VllmEngineArgs(extra_engine_args={"kv_offloading_size": 4})


@needs_vllm
def test_vllm_config_turns_the_gib_into_its_offloading_connector(smollm2_dir,
                                                                  restored_environ):
    """The config vLLM builds (no engine started): the size is GiB, and offloading is a
    KV connector of vLLM's, which is why a disaggregated engine cannot have both."""
    ea = to_engine_args(offloading(max_model_len=1024), str(smollm2_dir), "served")
    cfg = ea.create_engine_config()
    kt = cfg.kv_transfer_config
    assert (kt.kv_connector, kt.kv_role) == ("OffloadingConnector", "kv_both")
    assert kt.kv_connector_extra_config["cpu_bytes_to_use"] == 2.5 * GIB


def offload_config(extra: dict, events: bool = False):
    """vLLM's ``OffloadingConfig`` for one rank with ``extra`` as the connector's extra
    config (what its offloading specs are built from)."""
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    return OffloadingConfig(
        groups=(), worker_kv_bytes_per_block=0, enable_kv_cache_events=events,
        extra_config=extra, engine_id="e",
        model=OffloadingModelConfig(name="m", dtype="float32"),
        cache=OffloadingCacheConfig(tokens_per_hash=128, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
            data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
            is_parallelism_agnostic=True))


@needs_vllm
def test_vllm_offload_events_are_self_describing_when_kv_events_are_on(smollm2_dir,
                                                                       restored_environ):
    """With KV events on, the offloading connector vLLM builds from the size also gets
    the switch for events that carry each offloaded block's tokens and parent (the
    routers' tier index keys blocks by them), read where vLLM's offloading spec reads it;
    the engine then declares its host tier."""
    from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

    args = offloading(max_model_len=1024, kv_events=True)
    ea = to_engine_args(args, str(smollm2_dir), "served",
                        kv_events_endpoint="tcp://127.0.0.1:5999")
    kt = ea.create_engine_config().kv_transfer_config
    assert (kt.kv_connector, kt.kv_role) == ("OffloadingConnector", "kv_both")
    assert kt.kv_connector_extra_config == {SELF_DESCRIBING: True,
                                            "cpu_bytes_to_use": 2.5 * GIB}

    spec = CPUOffloadingSpec(offload_config(kt.kv_connector_extra_config, events=True))
    assert spec.kv_events_config.self_describing_kv_events is True
    assert args.lower_tiers() == {"host": None}
    # KV events off: no tier to announce, vLLM's config untouched.
    quiet = offloading(max_model_len=1024, kv_events=False)
    assert quiet.lower_tiers() == {}
    kt = to_engine_args(quiet, str(smollm2_dir), "served").create_engine_config() \
        .kv_transfer_config
    assert SELF_DESCRIBING not in kt.kv_connector_extra_config
    assert offloading(kv_offloading_backend="lmcache").lower_tiers() == {}


@needs_vllm
def test_vllm_cpu_platform_refuses_the_native_tier():
    """What the docs say of the CPU build: vLLM's native tier builds its config there
    but refuses to create the worker side, so the engine fails at start."""
    from vllm.platforms import current_platform
    from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

    if not current_platform.is_cpu():
        pytest.skip("checks vLLM's CPU build")
    spec = CPUOffloadingSpec(offload_config({"cpu_bytes_to_use": GIB}))
    with pytest.raises(Exception, match="only supported on CUDA-alike and XPU"):
        spec.get_worker(None)


@pytest.mark.parametrize(("fields", "message"), [
    ({"kv_offloading_backend": "lmcache"}, "kv_offloading_backend: set without"),
    ({"kv_offloading_gib": -1}, "kv_offloading_gib"),
    ({"kv_offloading_gib": float("nan")}, "kv_offloading_gib"),
    ({"kv_offloading_backend": "mooncake"}, "kv_offloading_backend"),
    ({"host_kv_cache_gib": 2}, "host_kv_cache_gib: .*engine: vllm.*kv_offloading_gib"),
    ({"disk_kv_cache_gib": 2}, "disk_kv_cache_gib: .*engine: vllm.*no disk tier"),
    ({"disk_kv_cache_dir": "/d"}, "disk_kv_cache_dir: .*engine: vllm"),
])
def test_vllm_refuses_what_it_cannot_offload(fields, message):
    with pytest.raises(ValidationError, match=message):
        VllmEngineArgs(**fields)


@needs_vllm
def test_vllm_disaggregated_engine_cannot_offload():
    assert disaggregated_problems(VllmEngineArgs()) == []
    assert "kv_offloading_gib" in disaggregated_problems(offloading())[0]
    with pytest.raises(ValueError, match="kv_offloading_gib: .*NIXL"):
        to_engine_args(offloading(), "/m", "served", None, NIXL)
    assert to_engine_args(VllmEngineArgs(), "/m", "served", None, NIXL).kv_transfer_config


# --- SGLang ------------------------------------------------------------------------

MODEL = "/models/Llama-3.1-8B-Instruct"

HICACHE = {"enable_hierarchical_cache": True, "hicache_size_gb": 4,
           "hicache_write_policy": "write_back", "hicache_storage_backend": "file",
           "hicache_storage_backend_extra_config": {"file_storage_path": "/kv"}}


def hicache(**kw) -> SglangEngineArgs:
    """An SGLang config with HiCache, a 4 GB host tier and a file storage tier, with the
    model's directory filled in as the registry's factory does."""
    return SglangEngineArgs(**{**HICACHE, **kw}).model_copy(update={"model_path": MODEL})


@pytest.fixture
def sglang():
    """Skips a test without SGLang installed (the module's other tests still run)."""
    return sglang_module("sglang.srt.server_args")


@pytest.mark.parametrize("role", ["agg", "prefill"])
def test_hicache_lands_in_sglangs_server_args(sglang, role):
    from sglang.srt.arg_groups.hicache_hook import (
        handle_hicache,
        handle_hicache_ratio_default,
    )
    from sglang.srt.arg_groups.overrides import resolved_view

    kw = server_args_kwargs(hicache(), role, "m", EP)
    argv = to_cli_args(kw)
    for flag in ("--enable-hierarchical-cache", "--hicache-size", "--hicache-write-policy",
                 "--hicache-storage-backend", "--hicache-storage-backend-extra-config"):
        assert flag in argv
    sa = check_server_args(kw)  # SGLang's own flags, then its ServerArgs
    assert sa.enable_hierarchical_cache and not sa.disable_radix_cache
    assert (sa.hicache_size, sa.hicache_write_policy, sa.hicache_storage_backend) == (
        4, "write_back", "file")
    assert json.loads(sa.hicache_storage_backend_extra_config) == {"file_storage_path": "/kv"}
    # SGLang's own HiCache resolution steps (they run on CPU) accept it as given
    handle_hicache_ratio_default(sa)
    handle_hicache(sa)
    view = resolved_view(sa)
    assert (view.hicache_size, view.hicache_write_policy) == (4, "write_back")


def test_hicache_ratio_goes_alone(sglang):
    sa = check_server_args(server_args_kwargs(
        hicache(hicache_size_gb=0, hicache_ratio=3.0, hicache_storage_backend=None,
                hicache_storage_backend_extra_config=None), "agg", "m"))
    assert sa.hicache_ratio == 3.0 and sa.hicache_size == 0
    assert sa.hicache_storage_backend is None


def test_hicache_off_leaves_sglangs_defaults(sglang):
    kw = server_args_kwargs(SglangEngineArgs(model_path=None).model_copy(
        update={"model_path": MODEL}), "agg", "m")
    assert not any(k.startswith(("hicache", "enable_hierarchical")) for k in kw)
    assert not check_server_args(kw).enable_hierarchical_cache


def test_decode_engine_hicache_needs_the_decode_radix_cache(sglang):
    # valid as engine args (an aggregated Worker uses them as they are) ...
    args = hicache()
    assert decode_problems(args) and "enable_hierarchical_cache" in decode_problems(args)[0]
    # ... but a decode engine runs without a radix cache unless asked, and HiCache lives in it
    with pytest.raises(ValueError, match="enable_hierarchical_cache: .*decode_radix_cache"):
        server_args_kwargs(args, "decode", "m", EP)
    ok = hicache(decode_radix_cache=True)
    assert decode_problems(ok) == []
    sa = check_server_args(server_args_kwargs(ok, "decode", "m", EP))
    assert sa.enable_hierarchical_cache and sa.disaggregation_decode_enable_radix_cache


def test_sglang_refuses_an_unknown_storage_backend(sglang):
    with pytest.raises(ValidationError, match="hicache_storage_backend: SGLang refused"):
        SglangEngineArgs(enable_hierarchical_cache=True, hicache_storage_backend="tape")


def test_the_rules_checked_here_are_sglangs():
    """Rules this config repeats because SGLang's own step does not import on CPU, and
    the unit of hicache_size_gb: read from SGLang's source, so a change fails here."""
    sglang_source("srt/arg_groups/kv_cache_hook.py").require(
        "cfg.enable_hierarchical_cache and cfg.disable_radix_cache")
    sglang_source("srt/arg_groups/pd_disaggregation_hook.py").require(
        "disable_radix_cache=True")
    sglang_source("srt/mem_cache/pool_host/base.py").require("host_size * 1e9")


@pytest.mark.parametrize(("fields", "message"), [
    ({"hicache_ratio": 2.0}, "hicache_ratio: set without enable_hierarchical_cache"),
    ({"hicache_write_policy": "write_back"}, "hicache_write_policy: set without"),
    ({"hicache_storage_backend": "file"}, "hicache_storage_backend: set without"),
    ({"enable_hierarchical_cache": True, "enable_prefix_caching": False},
     "enable_hierarchical_cache: needs enable_prefix_caching"),
    ({"enable_hierarchical_cache": True, "hicache_ratio": 2.0, "hicache_size_gb": 8},
     "hicache_ratio 2.0 and hicache_size_gb 8"),
    ({"enable_hierarchical_cache": True,
      "hicache_storage_backend_extra_config": {"file_storage_path": "/kv"}},
     "hicache_storage_backend_extra_config: set without hicache_storage_backend"),
    ({"enable_hierarchical_cache": True, "hicache_ratio": 0}, "hicache_ratio"),
    ({"enable_hierarchical_cache": True, "hicache_size_gb": -1}, "hicache_size_gb"),
    ({"enable_hierarchical_cache": True, "hicache_write_policy": "lazy"},
     "hicache_write_policy"),
    ({"host_kv_cache_gib": 2}, "host_kv_cache_gib: .*engine: sglang.*hicache"),
    ({"disk_kv_cache_dir": "/d"}, "disk_kv_cache_dir: .*engine: sglang.*file_storage_path"),
    ({"extra_server_args": {"hicache_size": 4}}, r"extra_server_args\.hicache_size"),
])
def test_sglang_refuses_what_it_cannot_offload(fields, message):
    with pytest.raises(ValidationError, match=message):
        SglangEngineArgs(**fields)


# --- TensorRT-LLM ------------------------------------------------------------------


@pytest.mark.parametrize("role", ["agg", "prefill", "decode"])
def test_trtllm_host_cache_is_kv_cache_config_host_cache_size_in_bytes(role):
    """TensorRT-LLM's ``KvCacheConfig.host_cache_size`` is an ``Optional[int]`` of bytes
    (llmapi/llm_args.py); the LLM takes ``kv_cache_config`` as a dict of its fields."""
    kv = llm_kwargs(TrtllmEngineArgs(host_cache_gib=1.5), role)["kv_cache_config"]
    assert kv["host_cache_size"] == 1.5 * GIB and isinstance(kv["host_cache_size"], int)
    assert kv["enable_block_reuse"] is True
    assert "host_cache_size" not in llm_kwargs(TrtllmEngineArgs(), role)["kv_cache_config"]


@pytest.mark.parametrize(("fields", "message"), [
    ({"host_cache_gib": 1, "enable_block_reuse": False},
     "host_cache_gib 1.0: .*enable_block_reuse is false"),
    ({"host_cache_gib": -1}, "host_cache_gib"),
    ({"host_cache_gib": float("inf")}, "host_cache_gib"),
    ({"host_kv_cache_gib": 2}, "host_kv_cache_gib: .*engine: trtllm.*host_cache_gib"),
    ({"disk_kv_cache_gib": 2}, "disk_kv_cache_gib: .*engine: trtllm.*no disk KV tier"),
    ({"disk_kv_cache_dir": "/d"}, "disk_kv_cache_dir: .*engine: trtllm"),
    ({"extra_llm_args": {"kv_cache_config": {"host_cache_size": GIB}}},
     r"extra_llm_args\.kv_cache_config"),
])
def test_trtllm_refuses_what_it_cannot_offload(fields, message):
    with pytest.raises(ValidationError, match=message):
        TrtllmEngineArgs(**fields)
