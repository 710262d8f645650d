"""The one priority table: the QoS classes' order is every component's order.

Each class of each QoS section below (a class named ``batch`` included, wherever it
stands) ranks at its position in the section: in the contracts' table, in the QoS
config's own rank, and in the level the router puts on its reply.  Names the table lacks
are refused by ``level`` and mapped to the default class by the one documented rule.
"""

from __future__ import annotations

import asyncio

import pytest

from splitserve.components.router.qos import QosConfig
from splitserve.components.router.qos.classes import default_classes
from splitserve.components.router.service import RouterService
from splitserve.components.router.service_config import RouterComponentConfig, load_policy
from splitserve.contracts.prefill_queue import PrefillQueueConfig
from splitserve.contracts.priority import (
    DEFAULT_LEVEL,
    DEFAULT_TABLE,
    PriorityTable,
    UnknownPriority,
)
from splitserve.contracts.wire import RouteCall, RouteReply

pytestmark = pytest.mark.unit


def cls(name: str) -> dict:
    return {"name": name, "ttft_ms": 1000, "tpot_ms": 100}


SECTIONS = {
    # name: (classes, default_class, {class: expected level})
    "built-in": (None, "default", {"high": 0, "default": 1, "low": 2}),
    "batch last": ([cls("high"), cls("default"), cls("batch")], "default",
                   {"high": 0, "default": 1, "batch": 2}),
    "batch below low": ([cls("high"), cls("default"), cls("low"), cls("batch")], "default",
                        {"high": 0, "default": 1, "low": 2, "batch": 3}),
    "batch first": ([cls("batch"), cls("default")], "default", {"batch": 0, "default": 1}),
    "own names": ([cls("interactive"), cls("standard"), cls("batch")], "standard",
                  {"interactive": 0, "standard": 1, "batch": 2}),
    "one class": ([cls("default")], "default", {"default": 0}),
}


def qos(classes, default_class) -> QosConfig:
    doc = {"default_class": default_class}
    if classes is not None:
        doc["classes"] = classes
    return QosConfig.model_validate(doc)


def cases():
    for section, (classes, default_class, levels) in SECTIONS.items():
        for name, level in levels.items():
            yield pytest.param(classes, default_class, name, level, id=f"{section}-{name}")


@pytest.mark.parametrize(("classes", "default_class", "name", "level"), cases())
def test_every_class_ranks_at_its_position_in_the_qos_section(classes, default_class, name,
                                                               level):
    config = qos(classes, default_class)
    table = config.priority_table()
    assert table.classes == tuple(c.name for c in config.classes)
    assert table.level(name) == level
    assert config.rank(name) == level
    assert table.level_of(name) == level


@pytest.mark.parametrize(("classes", "default_class", "name", "level"), cases())
def test_the_router_puts_the_class_level_on_its_reply(classes, default_class, name, level):
    cfg = RouterComponentConfig(policy="round_robin", use_kv_events=False,
                                qos=qos(classes, default_class))

    class Workers:
        def instance_ids(self):
            return [1]

    svc = RouterService(cfg, load_policy(cfg), Workers())

    async def route() -> RouteReply:
        call = RouteCall(request_id="r", token_ids=list(range(8)), priority=name)
        async for reply in svc.route(call.model_dump()):
            return RouteReply.model_validate(reply)
        raise AssertionError("no reply")

    reply = asyncio.run(route())
    assert (reply.worker_id, reply.class_name, reply.class_level) == (1, name, level)


def test_the_built_in_table_is_the_qos_default_classes_and_the_queue_levels():
    assert DEFAULT_TABLE.classes == tuple(c.name for c in default_classes())
    assert QosConfig().priority_table() == DEFAULT_TABLE
    queue = PrefillQueueConfig()
    assert queue.table() == DEFAULT_TABLE
    assert DEFAULT_LEVEL == DEFAULT_TABLE.level("default") == 1


UNKNOWN = {
    # name: (table, name, level under the rule)
    "unknown name": (DEFAULT_TABLE, "urgent", 1),
    "batch in the built-in table": (DEFAULT_TABLE, "batch", 1),
    "the old 'normal' alias": (DEFAULT_TABLE, "normal", 1),
    "none": (DEFAULT_TABLE, None, 1),
    "empty": (DEFAULT_TABLE, "", 1),
    "case and space": (DEFAULT_TABLE, " High ", 0),
    "another default": (PriorityTable(("gold", "silver", "bronze"), "bronze"), "tin", 2),
    "exact name kept": (PriorityTable(("P0", "P1"), "P1"), "P0", 0),
}


@pytest.mark.parametrize(("table", "name", "level"), UNKNOWN.values(), ids=UNKNOWN.keys())
def test_a_name_the_table_lacks_is_refused_or_is_the_default_class(table, name, level):
    assert table.level_of(name) == level
    if name not in table.classes:
        with pytest.raises(UnknownPriority, match="unknown priority class") as err:
            table.level(name)
        assert str(list(table.classes)) in str(err.value)
        assert table.resolve(name) in (table.default, (name or "").strip().lower())


def test_qos_rank_of_an_unknown_name_is_the_default_class():
    config = qos([cls("high"), cls("standard"), cls("batch")], "standard")
    assert config.rank("mystery") == 1
    assert config.rank("batch") == 2


@pytest.mark.parametrize(("classes", "default", "message"), [
    ((), "default", "non-empty"),
    (("a", ""), "a", "non-empty"),
    (("a", "a"), "a", "unique"),
    (("a", "b"), "c", "default class 'c'"),
])
def test_a_table_is_checked_when_built(classes, default, message):
    with pytest.raises(ValueError, match=message):
        PriorityTable(classes, default)
