"""Queue names are valid NATS tokens for any namespace or model name."""

from __future__ import annotations

import re

import pytest

from splitserve.components.prefill_queue import queue_names, sanitise_token

pytestmark = pytest.mark.unit

TOKEN = re.compile(r"^[A-Za-z0-9_-]+$")


@pytest.mark.parametrize("name, expected", [
    ("dynamo", "dynamo"),
    ("team-a_1", "team-a_1"),
])
def test_safe_names_pass_unchanged(name: str, expected: str) -> None:
    assert sanitise_token(name) == expected


@pytest.mark.parametrize("name", [
    "meta-llama/Llama-3.1-8B-Instruct", "a.b", "a*b", "a>b", "with space", "tab\tx", "",
    "ünïcødé", "$JS", "x" * 200, "...", "a/b",
])
def test_unsafe_names_become_bounded_tokens(name: str) -> None:
    token = sanitise_token(name)
    assert TOKEN.match(token) and len(token) <= 48


@pytest.mark.parametrize("a, b", [("a/b", "a_b"), ("a.b", "a_b"), ("x" * 60, "x" * 61),
                                  ("a b", "a/b")])
def test_distinct_inputs_stay_distinct(a: str, b: str) -> None:
    assert sanitise_token(a) != sanitise_token(b)


def test_sanitising_is_deterministic() -> None:
    assert sanitise_token("org/model.v1") == sanitise_token("org/model.v1")


def test_queue_names_layout() -> None:
    names = queue_names("prod ns", "org/Model-7B.v2", levels=3)
    assert names.levels == 3
    assert TOKEN.match(names.stream) and names.stream.startswith("PREFILL_")
    assert names.consumers == ("prefill-p0", "prefill-p1", "prefill-p2")
    for subject in (*names.subjects, names.bell):
        tokens = subject.split(".")
        assert all(TOKEN.match(t) for t in tokens), subject
    assert [s.rsplit(".", 1)[1] for s in names.subjects] == ["p0", "p1", "p2"]
    assert names.bell not in names.subjects


def test_queue_names_separate_namespaces_and_models() -> None:
    assert queue_names("a", "m", 1).stream != queue_names("b", "m", 1).stream
    assert queue_names("a", "m1", 1).subjects != queue_names("a", "m2", 1).subjects


def test_queue_needs_a_level() -> None:
    with pytest.raises(ValueError, match="at least one"):
        queue_names("a", "m", 0)
