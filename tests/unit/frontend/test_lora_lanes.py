"""LoRA adapters at the frontend: each served under its own name on its base model's
lane once a worker reports it loaded, the vLLM-style management endpoints behind the
graph's control token (401 / 403 / 400 / 404 / 504), and the backends sending an
adapter request only where it is loaded.

etcd is played by ``Store``: a write updates the frontend's catalog as its watch would,
and ``Fleet`` answers for the workers (each loads a new record, or fails, or says
nothing), writing their statuses the way ``components/worker/loras.py`` does."""

from __future__ import annotations

import asyncio

import pytest
from starlette.testclient import TestClient

from splitserve.components.frontend.app import FrontendState, build_app
from splitserve.components.frontend.backend import BackendMetrics, DirectBackend, StreamMeta
from splitserve.components.frontend.errors import APIError
from splitserve.components.frontend.loras import AdapterCatalog
from splitserve.components.frontend.request import WorkerCall
from splitserve.contracts.kit.loras import LoraKeys, LoraRecord, LoraStatus, LoraView
from tests.unit.frontend.test_backend import Workers, routed
from tests.unit.frontend.test_frontend_app import ScriptedBackend
from tests.unit.worker.lora_engine import adapter_dir

pytestmark = pytest.mark.unit

BASE, NS, TOKEN = "base-model", "dynamo", "t" * 32
AUTH = {"Authorization": f"Bearer {TOKEN}"}


class Fleet(ScriptedBackend):
    """The base model's workers: ``ids``; each loads a new adapter (``answer``:
    "loaded", "failed", "unsupported" or None for no answer)."""

    def __init__(self, codec, ids=(0xA, 0xB), answer="loaded") -> None:
        super().__init__(codec, reply="adapted")
        self.workers, self.answer = list(ids), answer

    def worker_ids(self) -> list[int]:
        return list(self.workers)


class Store:
    """etcd for one namespace: ``items`` key -> value, mirrored into the catalog."""

    def __init__(self, catalog: AdapterCatalog, fleet: Fleet) -> None:
        self.catalog, self.fleet, self.keys = catalog, fleet, LoraKeys(NS)
        self.items: dict[str, bytes] = {}
        self.writes: list[tuple[str, str]] = []

    def sync(self) -> None:
        self.catalog.update(NS, LoraView.from_items(self.keys, self.items))

    def status(self, name: str, worker: int, state: str, path: str, error: str = "") -> None:
        self.items[self.keys.status(name, worker)] = LoraStatus(
            state=state, path=path, error=error).model_dump_json().encode()
        self.sync()

    async def put(self, namespace: str, name: str, record: LoraRecord) -> None:
        assert namespace == NS
        self.writes.append(("put", name))
        self.items[self.keys.adapter(name)] = record.model_dump_json().encode()
        self.sync()
        if self.fleet.answer is not None:  # the workers react to the watch
            for w in self.fleet.workers:
                why = {"failed": "bad weights", "unsupported": "no LoRA here"}.get(
                    self.fleet.answer, "")
                self.status(name, w, self.fleet.answer, record.path, why)

    async def delete(self, namespace: str, name: str) -> None:
        self.writes.append(("delete", name))
        for key in [k for k in self.items if k == self.keys.adapter(name)
                    or k.startswith(f"{self.keys.statuses}{name}/")]:
            del self.items[key]
        self.sync()


def app(codec, answer="loaded", token=TOKEN, timeout_s=0.3, ids=(0xA, 0xB)):
    fleet = Fleet(codec, ids, answer)
    catalog = AdapterCatalog()
    store = Store(catalog, fleet)
    state = FrontendState(model_name=BASE, codec=codec, backend=fleet, namespace=NS,
                          adapters=catalog, adapter_store=store, control_token=token,
                          lora_load_timeout_s=timeout_s)
    return TestClient(build_app(state)), fleet, store, state


def ask(c: TestClient, model: str):
    return c.post("/v1/chat/completions", json={
        "model": model, "max_tokens": 20, "messages": [{"role": "user", "content": "Hi"}]})


def load(c: TestClient, name: str, path, headers=AUTH, **extra):
    return c.post("/v1/load_lora_adapter", headers=headers,
                  json={"lora_name": name, "lora_path": str(path), **extra})


def models(c: TestClient) -> dict[str, dict]:
    return {m["id"]: m for m in c.get("/v1/models").json()["data"]}


# ---- lanes --------------------------------------------------------------------------------

def test_a_loaded_adapter_is_served_under_its_name_on_its_base_models_workers(
        codec, tmp_path):
    c, fleet, _, state = app(codec)
    r = load(c, "sql", adapter_dir(tmp_path, "sql"))
    assert r.status_code == 200, r.text
    assert r.json()["workers"] == {"a": {"state": "loaded"}, "b": {"state": "loaded"}}
    listed = models(c)
    assert listed["sql"]["parent"] == listed["sql"]["root"] == BASE
    assert listed[BASE]["parent"] is None
    r = ask(c, "sql")
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "sql"
    assert r.json()["choices"][0]["message"]["content"] == "adapted"
    sent = fleet.requests[-1]
    assert sent["model"] == BASE and sent["extra_args"]["splitserve"]["lora"] == "sql"
    assert sent["token_ids"] == codec.chat_ids([{"role": "user", "content": "Hi"}])
    r = ask(c, BASE)
    assert "lora" not in fleet.requests[-1]["extra_args"]["splitserve"]
    get = state.metrics.registry.get_sample_value
    assert get("splitserve_frontend_requests_total", {
        "endpoint": "chat", "outcome": "ok", "status": "200", "model": "sql",
        "base_model": BASE}) == 1
    assert get("splitserve_frontend_prompt_tokens_total",
               {"model": "sql", "base_model": BASE}) > 0
    assert get("splitserve_frontend_ttft_seconds_count",
               {"model": BASE, "base_model": BASE}) == 1


def test_an_adapter_is_listed_and_served_only_while_a_worker_has_it_loaded(codec, tmp_path):
    c, fleet, store, _ = app(codec, answer=None)
    path = adapter_dir(tmp_path, "sql")
    assert load(c, "sql", path).status_code == 504  # recorded, nobody answered yet
    assert "sql" not in models(c)
    r = ask(c, "sql")
    err = r.json()["error"]
    assert r.status_code == 404 and err["code"] == "model_not_found"
    assert "LoRA adapter of base-model that no worker has loaded yet" in err["message"]
    store.status("sql", 0xB, "loaded", str(path))
    assert "sql" in models(c) and ask(c, "sql").status_code == 200
    fleet.up = False
    assert models(c) == {}


def test_an_unknown_model_is_still_404(codec):
    c, fleet, _, _ = app(codec)
    r = ask(c, "no-such-adapter")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert not fleet.requests


# ---- management endpoints ------------------------------------------------------------------

@pytest.mark.parametrize(("headers", "token", "status", "phrase"), [
    ({}, TOKEN, 401, "needs the graph's control token"),
    ({"Authorization": "Bearer wrong"}, TOKEN, 401, "needs the graph's control token"),
    ({"Authorization": f"Basic {TOKEN}"}, TOKEN, 401, "needs the graph's control token"),
    (AUTH, None, 401, "started without the graph's control token"),
    ({**AUTH, "Origin": "http://evil.example"}, TOKEN, 403, "browser requests"),
])
def test_management_needs_the_control_token(codec, tmp_path, headers, token, status,
                                            phrase):
    c, _, store, _ = app(codec, token=token)
    for method, path, body in (
            ("POST", "/v1/load_lora_adapter",
             {"lora_name": "sql", "lora_path": str(adapter_dir(tmp_path, "sql"))}),
            ("POST", "/v1/unload_lora_adapter", {"lora_name": "sql"}),
            ("GET", "/v1/lora_adapters", None)):
        r = c.request(method, path, headers=headers, json=body)
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert phrase in err["message"] and TOKEN not in r.text
        if status == 401:
            assert r.headers["www-authenticate"] == "Bearer"
            assert err["type"] == "authentication_error"
    assert store.writes == []


def test_load_refuses_bad_input_by_name(codec, tmp_path):
    c, _, store, _ = app(codec)
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = [
        ({"lora_name": "a/b", "lora_path": str(empty)}, "lora_name", "not a valid adapter"),
        ({"lora_name": BASE, "lora_path": str(empty)}, "lora_name", "served model's name"),
        ({"lora_path": str(empty)}, "lora_name", "must be a non-empty string"),
        ({"lora_name": "sql"}, "lora_path", "must be a non-empty string"),
        ({"lora_name": "sql", "lora_path": str(tmp_path / "nope")}, "lora_path",
         "no such directory"),
        ({"lora_name": "sql", "lora_path": str(empty)}, "lora_path",
         "no adapter_config.json"),
        ({"lora_name": "sql", "lora_path": str(adapter_dir(tmp_path, "x")),
          "base_model": "gpt-4o"}, "base_model", "not served here"),
    ]
    for body, param, phrase in cases:
        r = c.post("/v1/load_lora_adapter", headers=AUTH, json=body)
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert err["param"] == param and phrase in err["message"], (body, err)
    r = c.post("/v1/load_lora_adapter", headers=AUTH, content=b"[1]")
    assert r.status_code == 415
    r = c.post("/v1/load_lora_adapter", headers=AUTH,
               json={"lora_name": "sql", "lora_path": "x" * 70_000})
    assert r.status_code == 413
    r = c.post("/v1/load_lora_adapter", headers={**AUTH, "content-type": "application/json"},
               content=b"{not json")
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    assert store.writes == []


def test_a_load_every_worker_fails_is_400_naming_why_and_leaves_nothing(codec, tmp_path):
    c, _, store, _ = app(codec, answer="failed")
    r = load(c, "sql", adapter_dir(tmp_path, "sql"))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "lora_load_failed" and "bad weights" in err["message"]
    assert store.writes == [("put", "sql"), ("delete", "sql")]
    c, _, _, _ = app(codec, answer="unsupported")
    r = load(c, "sql", adapter_dir(tmp_path, "sql"))
    assert r.status_code == 400 and r.json()["error"]["code"] == "lora_not_supported"
    assert "no LoRA here" in r.json()["error"]["message"]


def test_load_with_no_worker_running_is_503(codec, tmp_path):
    c, _, store, _ = app(codec, ids=())
    r = load(c, "sql", adapter_dir(tmp_path, "sql"))
    assert r.status_code == 503 and r.json()["error"]["code"] == "no_workers"
    assert store.writes == []


def test_loading_again_is_idempotent_and_another_path_is_refused(codec, tmp_path):
    c, _, store, _ = app(codec)
    path = adapter_dir(tmp_path, "sql")
    assert load(c, "sql", path).status_code == 200
    assert load(c, "sql", path).status_code == 200
    assert store.writes == [("put", "sql")]
    r = load(c, "sql", adapter_dir(tmp_path, "other"))
    assert r.status_code == 400 and r.json()["error"]["code"] == "lora_exists"


def test_unload(codec, tmp_path):
    c, _, store, _ = app(codec)
    assert load(c, "sql", adapter_dir(tmp_path, "sql")).status_code == 200
    r = c.post("/v1/unload_lora_adapter", headers=AUTH, json={"lora_name": "sql"})
    assert r.status_code == 200 and r.json()["still_loaded_on"] == []
    assert ask(c, "sql").status_code == 404 and "sql" not in models(c)
    r = c.post("/v1/unload_lora_adapter", headers=AUTH, json={"lora_name": "sql"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "lora_not_found"
    store.items[store.keys.adapter("cfg")] = LoraRecord(
        path="/x", base_model=BASE, source="config").model_dump_json().encode()
    store.sync()
    r = c.post("/v1/unload_lora_adapter", headers=AUTH, json={"lora_name": "cfg"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "lora_from_config"
    r = c.post("/v1/unload_lora_adapter", headers=AUTH,
               json={"lora_name": "cfg", "force": True})
    assert r.status_code == 200 and store.writes[-1] == ("delete", "cfg")


def test_list_shows_records_and_each_workers_status(codec, tmp_path):
    c, _, store, _ = app(codec)
    path = adapter_dir(tmp_path, "sql")
    load(c, "sql", path)
    store.status("sql", 0xB, "failed", str(path), "no slot left")
    data = c.get("/v1/lora_adapters", headers=AUTH).json()["data"]
    assert data == [{"id": "sql", "base_model": BASE, "path": str(path), "source": "api",
                     "namespace": NS, "served": True,
                     "workers": {"a": {"state": "loaded"},
                                 "b": {"state": "failed", "error": "no slot left"}}}]


# ---- backends -----------------------------------------------------------------------------

def call(lora=None) -> WorkerCall:
    return WorkerCall(model=BASE, token_ids=(1, 2, 3), max_tokens=2, request_id="r",
                      priority="default", lora=lora)


def stream(backend, req) -> list[dict]:
    async def go():
        return [c async for c in backend.stream(req, StreamMeta("r", None), None)]
    return asyncio.run(go())


def test_without_a_router_an_adapter_request_goes_only_where_it_is_loaded():
    workers = Workers([1, 2, 3])
    holders = {"sql": {2}}
    backend = DirectBackend(workers, metrics=BackendMetrics(),
                            adapter_workers=lambda name: holders.get(name, set()))
    for _ in range(3):
        stream(backend, call("sql"))
    assert workers.sent == [2, 2, 2]
    with pytest.raises(APIError) as exc:
        stream(backend, call("chat"))
    assert (exc.value.status, exc.value.code) == (503, "lora_not_loaded")


def test_the_router_gets_the_adapter_and_its_refusal_is_a_clear_503():
    workers = Workers([1, 2])
    backend, svc = routed(workers)
    from splitserve.contracts.wire import WorkerLoad

    svc.on_load(WorkerLoad(worker_id=2, loras=["sql"]).model_dump_json().encode())
    stream(backend, call("sql"))
    assert workers.sent == [2]
    assert workers.requests[-1]["extra_args"]["splitserve"]["lora"] == "sql"
    with pytest.raises(APIError) as exc:
        stream(backend, call("chat"))
    assert (exc.value.status, exc.value.code) == (503, "lora_not_loaded")
    assert "'chat'" in exc.value.message


def test_without_base_model_the_adapter_goes_on_the_model_its_config_names(codec, tmp_path):
    """Several models in one graph: PEFT writes the base's directory (or hub id) into the
    adapter's config, so a load that names no base finds it there; the graph's first
    model when the config names none of them (or several)."""
    import json

    from splitserve.components.frontend.lora_api import default_base
    from splitserve.components.frontend.state import ModelLane

    c, fleet, store, state = app(codec)
    other_ns = "dynamo-qwen"
    qwen_dir = tmp_path / "models" / "tiny-qwen3"
    qwen_dir.mkdir(parents=True)
    state.model_source = "SmolLM2-135M-Instruct"
    qwen = ModelLane("qwen3", Fleet(codec, ids=(0xC,)), codec, namespace=other_ns,
                     source=str(qwen_dir))
    lanes = [state.first_lane(), qwen]

    def config(base) -> dict:
        return {"peft_type": "LORA", "base_model_name_or_path": base}

    # the same directory, also written through a link or with a trailing slash
    link = tmp_path / "link"
    link.symlink_to(qwen_dir)
    for named in (str(qwen_dir), f"{qwen_dir}/", str(link), "qwen3"):
        assert default_base(lanes, config(named)) is qwen, named
    for named in ("SmolLM2-135M-Instruct", BASE):
        assert default_base(lanes, config(named)).name == BASE, named
    for named in (None, "", 7, "/nowhere", "meta-llama/Llama-3.1-8B-Instruct"):
        assert default_base(lanes, config(named)).name == BASE, named
    assert default_base(lanes, {}).name == BASE

    # through the endpoint: recorded under the pool whose model the config names
    state.pools["qwen3"] = qwen
    written: list[tuple[str, str]] = []

    async def put(namespace, name, record):  # no worker answers: the load times out
        written.append((namespace, record.base_model))

    store.put = put  # type: ignore[method-assign]
    path = adapter_dir(tmp_path, "qwen-sql")
    (path / "adapter_config.json").write_text(json.dumps(config(str(qwen_dir))))
    r = load(c, "qwen-sql", path)
    assert written == [(other_ns, "qwen3")], r.text
    path = adapter_dir(tmp_path, "plain")
    (path / "adapter_config.json").write_text(json.dumps(config(str(qwen_dir))))
    load(c, "plain", path, base_model=BASE)  # named: as asked, whatever the config
    assert written[-1] == (NS, BASE)
