"""One frontend serving several models (the config's ``Models`` pools): each request
goes to its own model's workers with its own model's tokenizer and name, /v1/models
lists the models a request would be served for now, and any other model gets 404
``model_not_found`` naming those served."""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from splitserve.components.frontend.app import FrontendState, build_app
from splitserve.components.frontend.state import ModelLane
from splitserve.components.frontend.textcodec import TextCodec
from tests.unit.frontend.test_frontend_app import ScriptedBackend

pytestmark = pytest.mark.unit

FIRST, OTHER = "first-model", "other-model"


@pytest.fixture(scope="module")
def other_codec(tiny_models) -> TextCodec:
    """A second model's own tokenizer files (a tiny Qwen3 directory: its generation
    config ends on two end-of-sequence ids)."""
    return TextCodec.from_dir(tiny_models["qwen3"])


def two_models(codec, other_codec):
    first = ScriptedBackend(codec, reply="from the first")
    other = ScriptedBackend(other_codec, reply="from the other")
    state = FrontendState(model_name=FIRST, codec=codec, backend=first)
    state.pools[OTHER] = ModelLane(OTHER, other, other_codec)
    return TestClient(build_app(state)), first, other


def ask(c: TestClient, model: str):
    return c.post("/v1/chat/completions", json={
        "model": model, "max_tokens": 20, "messages": [{"role": "user", "content": "Hi"}]})


def test_each_model_is_answered_by_its_own_workers(codec, other_codec):
    c, first, other = two_models(codec, other_codec)
    r = ask(c, OTHER)
    assert r.status_code == 200, r.text
    assert (r.json()["model"], r.json()["choices"][0]["message"]["content"]) == (
        OTHER, "from the other")
    sent = other.requests[0]
    assert sent["model"] == OTHER and not first.requests
    assert sent["eos_token_ids"] == list(other_codec.eos_token_ids) == [2, 7]
    r = ask(c, FIRST)
    assert r.json()["choices"][0]["message"]["content"] == "from the first"
    assert first.requests[0]["model"] == FIRST and len(other.requests) == 1


def test_models_lists_what_would_be_served_now(codec, other_codec):
    c, first, other = two_models(codec, other_codec)
    ids = lambda: [m["id"] for m in c.get("/v1/models").json()["data"]]  # noqa: E731
    assert ids() == [FIRST, OTHER]
    other.up = False  # its pool went away
    assert ids() == [FIRST]
    assert c.get("/ready").status_code == 200
    first.up = False
    assert ids() == [] and c.get("/ready").status_code == 503
    other.up = True
    assert ids() == [OTHER] and c.get("/ready").status_code == 200


def test_an_unknown_model_is_404_naming_the_served_ones(codec, other_codec):
    c, first, other = two_models(codec, other_codec)
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user",
                                                                 "content": "Hi"}]}),
                       ("/v1/completions", {"prompt": "Hi"})):
        r = c.post(path, json={"model": "gpt-4o", "max_tokens": 4, **body})
        assert r.status_code == 404, r.text
        err = r.json()["error"]
        assert (err["code"], err["param"]) == ("model_not_found", "model")
        assert FIRST in err["message"] and OTHER in err["message"]
    assert not first.requests and not other.requests


def test_each_model_has_its_own_context_window(codec, other_codec):
    c, _, _ = two_models(codec, other_codec)
    long = "word " * 600  # over the tiny model's 512 tokens, within the first's window
    r = c.post("/v1/completions", json={"model": OTHER, "prompt": long, "max_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert "512" in r.json()["error"]["message"]
    r = c.post("/v1/completions", json={"model": FIRST, "prompt": long, "max_tokens": 4})
    assert r.status_code == 200, r.text
