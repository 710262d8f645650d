'''Adding an engine is its folder plus one registry line: a toy engine, written to a
temporary folder by this test, is registered in a copy of the registry (the global one
is left alone); its sections then validate through the worker role models, and the
frontend learns from the toy's own declaration which request parameters to refuse.'''

from __future__ import annotations

import asyncio
import sys
import textwrap
from dataclasses import replace

import pytest
from pydantic import ValidationError
from starlette.testclient import TestClient

from splitserve.components.frontend.app import FrontendState, build_app
from splitserve.components.frontend.capabilities import graph_engines
from splitserve.components.frontend.textcodec import TextCodec
from splitserve.components.worker import registry
from splitserve.components.worker.agg import make_handler
from splitserve.contracts.config import ComponentRunConfig
from splitserve.contracts.kit.worker_metrics import WorkerMetrics
from splitserve.serve import catalog
from splitserve.serve.graph import merge_pipelines
from splitserve.serve.plan import build_plan
from tests.unit.worker.engine_conformance import ability_problems, class_problems

pytestmark = pytest.mark.unit

TOY_FOLDER = {
    "__init__.py": '''
        """A toy engine: echoes the prompt's last token; tokens below ``vocab_size``."""
    ''',
    "sections.py": '''
        """Config sections with ``engine: toy``."""

        from typing import Literal

        from pydantic import Field

        from splitserve.contracts.models import StrictModel
        from splitserve.contracts.sections import (
            EngineDecodeSection,
            EnginePrefillSection,
            WorkerCommon,
        )


        class ToyArgs(StrictModel):
            vocab_size: int = Field(100, ge=2)


        class ToyWorker(WorkerCommon):
            engine: Literal["toy"] = "toy"
            engine_args: ToyArgs = Field(default_factory=ToyArgs)


        class ToyDecodeWorker(EngineDecodeSection):
            engine: Literal["toy"] = "toy"
            engine_args: ToyArgs = Field(default_factory=ToyArgs)


        class ToyPrefillWorker(EnginePrefillSection):
            engine: Literal["toy"] = "toy"
            engine_args: ToyArgs = Field(default_factory=ToyArgs)


        SECTIONS = {"agg": ToyWorker, "decode": ToyDecodeWorker,
                    "prefill": ToyPrefillWorker}
    ''',
    "capabilities.py": '''
        """What the toy honours: a seed and top-k, nothing else the engine would apply."""

        from splitserve.contracts.engine import EngineRequestParams

        REQUEST_PARAMS = EngineRequestParams(honoured=frozenset({"seed", "top_k"}),
                                             notes={"seed": "toy: ignored, it is greedy"})
    ''',
    "engine.py": '''
        """The toy ``Engine``: no optional ability."""

        import asyncio

        from splitserve.contracts.engine import (
            EngineCapabilities,
            EngineInfo,
            LoadSample,
            OpaqueHandoff,
            PrefillResult,
            TokenDelta,
            WithoutFailureReport,
            WithoutHandoffFirst,
            WithoutKvMoves,
            WithoutKvPush,
            WithoutLora,
            WithoutPrefixLookup,
        )


        class ToyEngine(WithoutFailureReport, WithoutPrefixLookup, WithoutHandoffFirst,
                        WithoutKvPush, WithoutKvMoves, WithoutLora):
            info: EngineInfo

            def __init__(self, vocab_size: int, *, claims_moves: bool = False) -> None:
                self.vocab_size = vocab_size
                self.active = 0
                self.info = EngineInfo(name="toy", kv_block_size=16,
                                       capabilities=EngineCapabilities(
                                           local_prefill=True, pushes_kv=False,
                                           handoff_before_prefill=False,
                                           prefix_lookup=False, moves_kv=claims_moves,
                                           reports_failure=False))

            async def start(self) -> None:
                pass

            def validate(self, params) -> None:
                bad = [t for t in params.token_ids if not 0 <= t < self.vocab_size]
                if bad:
                    raise ValueError(f"token ids {bad} outside the toy's vocabulary")

            async def generate(self, request_id, params):
                self.active += 1
                try:
                    for i in range(params.max_tokens):
                        await asyncio.sleep(0)
                        yield TokenDelta(token_ids=(params.token_ids[-1],),
                                         finished=i == params.max_tokens - 1,
                                         prompt_tokens=len(params.token_ids))
                finally:
                    self.active -= 1

            async def prefill(self, request_id, params, destination=None):
                return PrefillResult(first_token=params.token_ids[-1],
                                     handoff=OpaqueHandoff())

            async def decode(self, request_id, params, handoff, first_token=None):
                async for d in self.generate(request_id, params):
                    yield d

            async def abort(self, request_id) -> None:
                pass

            async def run_kv_events(self, sink, ready=None) -> None:
                if ready is not None:
                    ready.set()

            def load(self):
                return LoadSample(active=self.active, waiting=0, kv_used_blocks=0,
                                  kv_total_blocks=0)

            def inflight(self) -> int:
                return self.active

            async def shutdown(self, drain_timeout_s: float = 0.0) -> None:
                pass


        def make_engine(ctx, cfg, role):
            return ToyEngine(cfg.engine_args.vocab_size)
    ''',
}


@pytest.fixture
def engines(tmp_path, monkeypatch):
    """The registry with the toy's one line added; the toy's folder on sys.path."""
    folder = tmp_path / "toy_engine"
    folder.mkdir()
    for name, text in TOY_FOLDER.items():
        (folder / name).write_text(textwrap.dedent(text).lstrip(), encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield {**registry.ENGINES,
           "toy": registry.EngineSpec(sections="toy_engine.sections",
                                      params="toy_engine.capabilities:REQUEST_PARAMS",
                                      engine="toy_engine.engine:ToyEngine",
                                      factory="toy_engine.engine:make_engine")}
    for name in [m for m in sys.modules if m.partition(".")[0] == "toy_engine"]:
        del sys.modules[name]


def test_its_sections_validate_through_the_worker_role_models(engines):
    for role in ("agg", "decode", "prefill"):
        model = catalog.worker_model(role, engines)
        cfg = model.model_validate({"engine": "toy", "engine_args": {"vocab_size": 50}})
        assert cfg.engine == "toy" and cfg.engine_args.vocab_size == 50
        assert type(cfg) is registry.section("toy", role, engines)
        with pytest.raises(ValidationError, match="vocab_size"):
            model.model_validate({"engine": "toy", "engine_args": {"vocab_size": 1}})
        assert model.model_validate({"engine": "mocker"}).engine == "mocker"
    # a decode section's offload policy is checked as for every engine
    with pytest.raises(ValidationError, match="disaggregated_router"):
        catalog.worker_model("decode", engines).model_validate(
            {"engine": "toy", "disaggregated_router": {"decider": "nope"}})
    # the global registry and the shipped catalog do not know it
    assert "toy" not in registry.ENGINES
    with pytest.raises(ValidationError, match="engine"):
        catalog.Worker.config_model.model_validate({"engine": "toy"})


def test_its_class_conforms_and_claims_no_ability_it_lacks(engines):
    cls = registry.engine_class("toy", engines)
    assert class_problems(cls) == []
    assert ability_problems(cls(100)) == []
    assert ability_problems(cls(100, claims_moves=True)) == [
        f"moves_kv is set, and {m} comes from WithoutKvMoves"
        for m in ("park", "parked", "export_parked", "resume_moved")]


def test_the_worker_shell_refuses_through_its_validate(engines):
    make = registry.resolve(engines["toy"].factory)
    cfg = registry.section("toy", "agg", engines).model_validate(
        {"engine_args": {"vocab_size": 10}})
    handler = make_handler(make(None, cfg, "agg"), WorkerMetrics())

    async def first_chunk() -> dict:
        request = {"token_ids": [3, 12], "stop_conditions": {"max_tokens": 2}}
        async for chunk in handler(request):
            return chunk
        return {}

    chunk = asyncio.run(first_chunk())
    assert "request refused" in chunk["error"] and "[12]" in chunk["error"]


class Backend:
    """Answers every request with one token."""

    def __init__(self, codec) -> None:
        self.token = codec.prompt_ids("Paris")[0]

    def ready(self) -> bool:
        return True

    async def stream(self, call, meta, context):
        request = call.to_wire()  # what the worker would receive
        from splitserve.contracts.wire import output_chunk

        yield output_chunk([self.token], "length", prompt_tokens=len(request["token_ids"]),
                           completion_tokens=1)


def test_the_frontend_learns_what_it_honours_from_its_folder(engines, smollm2_dir, tmp_path):
    toy_worker = replace(catalog.Worker, config_model=catalog.worker_model("agg", engines))
    graph = merge_pipelines([catalog.Frontend.link(toy_worker)], "Frontend")
    plan = build_plan(graph, "toy:Frontend", {"Worker": {"engine": "toy"}}, "<test>",
                      engines=engines)
    written = plan.run_config(plan.component("Frontend"), 0, tmp_path / "status.json")
    run = ComponentRunConfig.model_validate_json(written.model_dump_json())  # its file
    assert run.engines == ["toy"]
    learned = graph_engines(run)
    assert learned == {"toy": registry.request_params("toy", engines)}

    codec = TextCodec.from_dir(smollm2_dir)
    client = TestClient(build_app(FrontendState(model_name="m", codec=codec,
                                                backend=Backend(codec), engines=learned)))

    def chat(**extra):
        return client.post("/v1/chat/completions", json={
            "model": "m", "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 1, **extra})

    refused = chat(presence_penalty=0.5)
    assert refused.status_code == 400, refused.text
    err = refused.json()["error"]
    assert err["param"] == "presence_penalty" and err["code"] == "unsupported_parameter"
    assert "'presence_penalty' is not supported by the toy engine" in err["message"]
    assert chat(top_k=5).status_code == 200
    assert chat(seed=7).status_code == 200
    assert chat(presence_penalty=0).status_code == 200  # its no-op value
