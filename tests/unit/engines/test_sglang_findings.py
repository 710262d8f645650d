"""What SGLang 0.5.23 does to the process and the graph around it, and the adapter's
answers: the worker's SIGTERM handler kept, one engine per process, KV events only from
engines that have a radix cache, seeds only with deterministic inference, timeouts that
outlast SGLang's own, bootstrap ports per replica and the advertised host.  Where
SGLang's or Dynamo's installed source states the fact, the test reads it."""

from __future__ import annotations

import ast
import asyncio
import os
import signal
import sys
import types

import pytest
from pydantic import ValidationError

from splitserve.contracts.engine import GenerateParams, SglangBootstrapHandoff
from splitserve.components.engines.sglang import process
from splitserve.components.engines.sglang.config import (
    SGLANG_TIMEOUT_S,
    SglangEngineArgs,
    server_args_kwargs,
)
from splitserve.components.engines.sglang.engine import (
    SeedNeedsDeterminism,
    SglangEngine,
    default_factory,
)
from splitserve.components.engines.sglang.sections import (
    SglangDecodeWorkerConfig,
    SglangPrefillWorkerConfig,
)
from splitserve.components.engines.sglang.requests import sglang_rid
from tests.fixtures.engine_doubles import BootstrapRooms, SglangEngineDouble
from tests.unit.engines.upstream import dynamo_source, sglang_module, sglang_source

pytestmark = pytest.mark.unit

ARGS = SglangEngineArgs.model_construct(**{
    k: f.default for k, f in SglangEngineArgs.model_fields.items() if k != "extra_server_args"},
    extra_server_args={})
P = GenerateParams(token_ids=(5, 6, 7, 8), max_tokens=4, temperature=0.0)


def args(**kw) -> SglangEngineArgs:
    return ARGS.model_copy(update=kw)


def engine(role: str, rooms: BootstrapRooms, a: SglangEngineArgs = ARGS, **kw) -> SglangEngine:
    return SglangEngine(a, "m", role, factory=lambda **s: SglangEngineDouble(rooms, **s), **kw)


# ---- S4: SIGTERM stays the worker's -----------------------------------------------------
def test_sglang_and_dynamo_facts_about_the_sigterm_handler():
    src = sglang_source("srt/managers/tokenizer_manager.py")
    assert "loop.add_signal_handler(signal.SIGTERM" in src.after("def auto_create_handle_loop",
                                                                 1500)
    dynamo_source("sglang/shutdown.py").require("loop.add_signal_handler = ")


def test_sigterm_after_the_first_request_still_reaches_the_worker():
    import threading
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers need the main thread")

    async def go():
        loop = asyncio.get_running_loop()
        stopping = asyncio.Event()
        loop.add_signal_handler(signal.SIGTERM, stopping.set)  # as the component shell
        eng = engine("agg", BootstrapRooms())
        await eng.start()
        async for d in eng.generate("r", P):
            if d.finished:
                break
        os.kill(os.getpid(), signal.SIGTERM)
        await asyncio.wait_for(stopping.wait(), 5)
        assert not eng._engine.sigterm_seen
        # other signals still go through
        loop.add_signal_handler(signal.SIGUSR1, lambda: None)
        loop.remove_signal_handler(signal.SIGUSR1)
        await eng.shutdown()
    asyncio.run(go())


# ---- S5: one engine per process ---------------------------------------------------------
def test_a_second_real_engine_in_one_process_is_refused(monkeypatch):
    built: list[dict] = []

    class Engine:
        def __init__(self, **kw):
            built.append(kw)

    monkeypatch.setitem(sys.modules, "sglang", types.SimpleNamespace(Engine=Engine))
    process.release_process()
    try:
        default_factory(disaggregation_mode="decode")
        with pytest.raises(RuntimeError, match="process of its own"):
            default_factory(disaggregation_mode="null")
        assert len(built) == 1
    finally:
        process.release_process()


def test_local_prefill_engine_is_refused_by_config():
    with pytest.raises(ValidationError, match="one engine per process"):
        SglangDecodeWorkerConfig(local_prefill_engine=True)


# ---- S6: KV events only where a radix cache runs ----------------------------------------
def test_sglang_disables_the_decode_radix_cache_in_pd_mode():
    src = sglang_source("srt/arg_groups/pd_disaggregation_hook.py")
    block = src.after('if cfg.disaggregation_mode == "decode":', 1600)
    assert "if cfg.disaggregation_decode_enable_radix_cache:" in block
    assert "disable_radix_cache=True" in block and "disable_radix_cache=False" in block


def test_sglangs_own_resolution_agrees_with_the_decode_radix_cache_setting():
    sglang_module("sglang.srt.arg_groups.pd_disaggregation_hook")
    from splitserve.components.engines.sglang.config import (
        check_server_args,
        resolved_radix_cache,
    )

    for asked in (False, True):
        # the model's directory is filled in by the registry's factory (make_engine)
        a = args(decode_radix_cache=asked, model_path="/models/m")
        for role, expect in (("decode", asked), ("prefill", True)):
            built = check_server_args(server_args_kwargs(a, role, "m", "tcp://127.0.0.1:1"))
            assert resolved_radix_cache(built) is expect, (role, asked)
    # validation runs the same resolution (and would name a disagreement)
    SglangEngineArgs(decode_radix_cache=True)


def test_prefill_and_plain_decode_engines_publish_no_kv_events():
    rooms = BootstrapRooms()
    assert engine("agg", rooms).kv_endpoint is not None
    assert engine("prefill", rooms).kv_endpoint is None
    assert engine("decode", rooms).kv_endpoint is None
    dec = engine("decode", rooms, args(decode_radix_cache=True))
    assert dec.kv_endpoint is not None
    assert dec.server_kwargs()["disaggregation_decode_enable_radix_cache"] is True


def test_kv_routing_over_decode_engines_without_events_is_refused():
    router = types.SimpleNamespace(policy="kv_aware", block_size=16)
    errs = SglangDecodeWorkerConfig().graph_checks({"Router": router})
    assert errs and "decode_radix_cache" in errs[0]
    ok = SglangDecodeWorkerConfig(engine_args={"decode_radix_cache": True})
    assert ok.graph_checks({"Router": router}) == []
    rr = types.SimpleNamespace(policy="round_robin", block_size=16)
    assert SglangDecodeWorkerConfig().graph_checks({"Router": rr}) == []


# ---- S7: seeds ------------------------------------------------------------------------
def test_sglang_uses_sampling_seed_only_in_deterministic_mode():
    src = sglang_source("srt/sampling/sampling_batch_info.py")
    assert "if enable_deterministic" in src.after("sampling_seed = (", 600)


def test_a_seed_is_refused_unless_the_engine_is_deterministic():
    seeded = GenerateParams(token_ids=(1, 2), max_tokens=2, seed=7)

    async def go():
        rooms = BootstrapRooms()
        agg = engine("agg", rooms)
        await agg.start()
        with pytest.raises(SeedNeedsDeterminism, match="deterministic_inference"):
            agg.generate("s", seeded)
        with pytest.raises(SeedNeedsDeterminism):
            agg.validate(seeded)
        det = engine("agg", rooms, args(deterministic_inference=True))
        assert det.server_kwargs()["enable_deterministic_inference"] is True
        await det.start()
        async for d in det.generate("s", seeded):
            if d.finished:
                break
        assert det._engine.calls[-1]["sampling_params"]["sampling_seed"] == 7
    asyncio.run(go())


# ---- S8: timeouts -----------------------------------------------------------------------
def test_sglangs_own_disaggregation_timeouts_are_300_s():
    sglang_source("srt/environ.py").require(*(
        f"{name} = EnvInt({SGLANG_TIMEOUT_S})" for name in (
            "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT", "SGLANG_DISAGGREGATION_WAITING_TIMEOUT")))
    assert set(process.disagg_timeout_env(1, 2)) == {
        "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT", "SGLANG_DISAGGREGATION_WAITING_TIMEOUT"}


def test_prefill_loop_outlasts_sglangs_timeouts():
    assert SglangPrefillWorkerConfig().prefill_timeout_s > 2 * SGLANG_TIMEOUT_S
    with pytest.raises(ValidationError, match="bootstrap_timeout_s"):
        SglangPrefillWorkerConfig(prefill_timeout_s=120)
    SglangPrefillWorkerConfig(prefill_timeout_s=120, engine_args={
        "bootstrap_timeout_s": 50, "waiting_timeout_s": 60})


def test_decode_gives_up_when_the_kv_never_arrives():
    async def go():
        dec = engine("decode", BootstrapRooms(), args(waiting_timeout_s=0), decode_margin_s=0.2)
        await dec.start()
        orphan = SglangBootstrapHandoff(bootstrap_host="127.0.0.1", bootstrap_port=8998,
                                        bootstrap_room=42)  # no prefill will ever come
        with pytest.raises(RuntimeError, match="never arrived"):
            async for _ in dec.decode("d", P, orphan):
                pass
        assert sglang_rid("d") in dec._engine.aborted and dec.inflight() == 0
    asyncio.run(go())


# ---- S3: per-replica bootstrap port, advertised host ------------------------------------
def test_bootstrap_port_per_replica_and_advertised_host():
    async def go():
        rooms = BootstrapRooms()
        pre = engine("prefill", rooms, host="10.0.0.5", advertise_host="203.0.113.7", replica=2)
        assert pre.server_kwargs()["disaggregation_bootstrap_port"] == 8998 + 2
        assert pre.server_kwargs()["host"] == "10.0.0.5"
        await pre.start()
        ticket = await pre.begin_prefill("p", P)
        assert (ticket.handoff.bootstrap_host, ticket.handoff.bootstrap_port) == (
            "203.0.113.7", 9000)
        ticket.result.cancel()
        await pre.shutdown()
    asyncio.run(go())
    assert SglangPrefillWorkerConfig().replica_ports(3) == {"bootstrap_port": 9001}
    assert server_args_kwargs(ARGS, "prefill", "m", bootstrap_port=9100)[
        "disaggregation_bootstrap_port"] == 9100


# ---- S9: SGLang's KV manager binds and advertises SGLANG_HOST_IP -----------------------
def function_source(src, name: str) -> str:
    fn = src.node(ast.FunctionDef, name)
    return ast.get_source_segment(src.text, fn) or ""


def test_sglang_kv_manager_binds_and_advertises_the_host_ip_variable():
    net = sglang_source("srt/utils/network.py")
    body = function_source(net, "get_local_ip_auto")
    assert f'os.getenv("{process.KV_HOST_VARIABLE}", "")' in body, (
        f"{net.label}: get_local_ip_auto no longer reads {process.KV_HOST_VARIABLE}")
    first = body.index("os.getenv(")
    assert body.index("return host_ip") < body.index("get_local_ip_by_nic()", first), (
        f"{net.label}: get_local_ip_auto no longer returns the variable before probing")
    conn = sglang_source("srt/disaggregation/common/conn.py")
    conn.require(
        "self.local_ip = get_local_ip_auto()",      # one address ...
        "host=self.local_ip",                       # ... bound (get_zmq_socket_on_host)
        '"rank_ip": self.local_ip',                 # ... registered with the bootstrap server
        "self.kv_mgr.local_ip.encode(\"ascii\")",   # ... sent by the decode side
    )
    assert "host=self.local_ip" in conn.after("self.rank_port, self.server_socket = "
                                              "get_zmq_socket_on_host(", 200)
    for backend in ("nixl", "mooncake"):
        src = sglang_source(f"srt/disaggregation/{backend}/conn.py")
        src.require("(StagingManagerMixin, CommonKVManager)", "self.local_ip.encode(\"ascii\")")
    # Dynamo's SGLang worker names the same address as the prefill's bootstrap host.
    disagg = dynamo_source("sglang/_disagg.py")
    assert "local_ip = get_local_ip_auto()" in function_source(
        disagg, "compute_bootstrap_address")


def test_kv_manager_host_is_the_advertised_address_not_the_bind_host():
    rooms = BootstrapRooms()
    for role in ("prefill", "decode"):
        eng = engine(role, rooms, host="0.0.0.0", advertise_host="10.1.2.3")
        assert eng.engine_env()["SGLANG_HOST_IP"] == "10.1.2.3", role
        assert eng.server_kwargs()["host"] == "0.0.0.0"  # the listeners still bind host
    assert engine("decode", rooms, host="10.0.0.5").engine_env()["SGLANG_HOST_IP"] == "10.0.0.5"
    assert engine("prefill", rooms).engine_env()["SGLANG_HOST_IP"] == "127.0.0.1"
    assert engine("agg", rooms, advertise_host="10.1.2.3").engine_env() == {}


def test_an_advertise_host_this_machine_cannot_bind_is_refused_before_sglang_starts():
    process.check_kv_host("127.0.0.1")
    with pytest.raises(RuntimeError, match="203.0.113.7"):
        process.check_kv_host("203.0.113.7")  # TEST-NET-3: never a local address


def test_min_tokens_reach_sglang_as_min_new_tokens():
    from splitserve.components.engines.sglang.requests import sampling_params
    sglang_source("srt/sampling/sampling_params.py").require("min_new_tokens: int = 0")
    sp = sampling_params(GenerateParams(token_ids=(1,), max_tokens=1, min_tokens=1,
                                        ignore_eos=True))
    assert sp["min_new_tokens"] == 1 and sp["ignore_eos"] is True


# ---- round 2, finding 14: aborts match by id prefix ---------------------------------------
def test_sglangs_scheduler_aborts_by_id_prefix():
    """The rule the ids below are made for, read from the installed scheduler."""
    src = sglang_source("srt/managers/scheduler.py").text
    assert "req.rid.startswith(recv_req.rid)" in src


@pytest.mark.parametrize(("one", "other"), [
    ("job@1", "job@10"), ("r", "r#local"), ("r", "r@2"), ("a$", "a$b"), ("a%24", "a$"),
    ("x", "x$"), ("", "$"),
])
def test_the_ids_sglang_gets_never_start_one_another(one, other):
    from splitserve.components.engines.sglang.requests import generate_kwargs

    for a, b in ((one, other), (other, one)):
        assert not sglang_rid(b).startswith(sglang_rid(a)), (a, b)
    p = GenerateParams(token_ids=(1, 2), max_tokens=2)
    assert generate_kwargs(one, p)["rid"] == sglang_rid(one)


def test_an_abort_names_the_id_sglang_got():
    from splitserve.components.engines.sglang.engine import SglangEngine

    sent: list[str] = []

    class Manager:
        def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
            sent.append(rid)

    engine = SglangEngine.__new__(SglangEngine)
    engine._engine = type("E", (), {"tokenizer_manager": Manager()})()
    asyncio.run(engine.abort("job@1"))
    assert sent == [sglang_rid("job@1")] and not sglang_rid("job@10").startswith(sent[0])


# ---- round 2, finding 13: SGLang's logger setup silenced the worker ------------------------
def test_sglang_engine_configures_logging_with_force():
    """The fact the fix is for, read from the installed source."""
    assert "configure_logger(server_args)" in sglang_source("srt/entrypoints/engine.py").text
    assert "force=True" in sglang_source("srt/utils/common.py").after(
        "def configure_logger", 1200)


def test_the_workers_info_logs_survive_sglangs_start():
    import logging

    configure_logger = sglang_module("sglang.srt.utils.common").configure_logger
    root = logging.getLogger()
    saved = list(root.handlers), root.level
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    mine = Keep()
    root.handlers[:] = [mine]
    root.setLevel(logging.INFO)
    try:
        def factory(**s):
            # what sglang.Engine does first: SGLang's own logger setup, at its log level
            configure_logger(types.SimpleNamespace(log_level="error"))
            return SglangEngineDouble(BootstrapRooms(), **s)

        eng = SglangEngine(ARGS, "m", "agg", factory=factory)
        asyncio.run(eng.start())
        logging.getLogger("splitserve.worker").info("the worker still speaks")
        assert root.handlers == [mine] and root.level == logging.INFO
        assert "the worker still speaks" in seen
    finally:
        root.handlers[:], _ = saved[0], root.setLevel(saved[1])


# ---- round 2, finding 6: load without KV events -------------------------------------------
def test_every_sglang_scheduler_writes_load_snapshots_with_the_fields_read():
    src = sglang_source("srt/managers/scheduler.py")
    assert "self.load_snapshot_writer = create_load_snapshot_writer(" in src.text
    LoadSnapshot = sglang_module("sglang.srt.managers.load_snapshot").LoadSnapshot
    for name in ("num_running_reqs", "num_waiting_reqs", "num_used_tokens",
                 "max_total_num_tokens"):
        assert name in LoadSnapshot.__struct_fields__, name
    assert "async def get_loads(" in sglang_source(
        "srt/managers/tokenizer_control_mixin.py").text


def test_a_prefill_engine_without_kv_events_reports_its_load():
    """A prefill engine publishes no KV events, so its scheduler pushes no KvMetrics:
    its load came out as 0 of 0 blocks and 0 waiting (the planner read an idle pool)."""
    async def go():
        eng = engine("prefill", BootstrapRooms())
        eng.tracker.poll_s = 0.01
        await eng.start()
        for _ in range(100):
            if eng.load().kv_total_blocks:
                break
            await asyncio.sleep(0.01)
        got = eng.load()
        assert got.kv_total_blocks == 4096 // ARGS.page_size and got.kv_used_blocks == 0
        await eng.shutdown()
    asyncio.run(go())


# ---- round 2, finding 10: prefill engines are warmed up before they serve -----------------
def test_the_warmup_host_is_sglangs_and_dynamo_warms_every_prefill_rank():
    from splitserve.components.engines.sglang.requests import FAKE_BOOTSTRAP_HOST

    assert f'FAKE_BOOTSTRAP_HOST = "{FAKE_BOOTSTRAP_HOST}"' in sglang_source(
        "srt/disaggregation/utils.py").text
    dynamo_source("sglang/_disagg.py").require(
        "bootstrap_host=FAKE_BOOTSTRAP_HOST", "routed_dp_rank=dp_rank")


@pytest.mark.parametrize("dp_size", [1, 2])
def test_a_prefill_engine_is_warmed_up_on_every_rank_before_start_returns(dp_size):
    from splitserve.components.engines.sglang.requests import FAKE_BOOTSTRAP_HOST

    async def go():
        built: list = []

        def factory(**s):
            built.append(SglangEngineDouble(BootstrapRooms(), **s))
            return built[-1]

        a = ARGS.model_copy(update={"extra_server_args": {"dp_size": dp_size}})
        eng = SglangEngine(a, "m", "prefill", factory=factory)
        assert eng.server_kwargs()["dp_size"] == dp_size
        await eng.start()
        warm = built[0].warmups
        assert sorted(w["bootstrap_room"] for w in warm) == list(range(dp_size))
        assert sorted(w["routed_dp_rank"] for w in warm) == list(range(dp_size))
        assert all(w["bootstrap_host"] == FAKE_BOOTSTRAP_HOST for w in warm)
        assert built[0].calls == []  # nothing served yet
        await eng.shutdown()
        for role in ("decode", "agg"):  # only prefill engines need it
            other = SglangEngine(ARGS, "m", role, factory=factory)
            await other.start()
            assert built[-1].warmups == []
            await other.shutdown()
    asyncio.run(go())


def test_a_prefill_engine_whose_warmup_fails_does_not_start():
    async def go():
        def factory(**s):
            double = SglangEngineDouble(BootstrapRooms(), **s)
            double.fail_warmup = True
            return double

        eng = SglangEngine(ARGS, "m", "prefill", factory=factory)
        with pytest.raises(RuntimeError, match="prefill path failed"):
            await eng.start()
    asyncio.run(go())
