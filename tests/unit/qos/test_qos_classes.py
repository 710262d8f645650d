"""Priority classes, the qos section's validation (with field paths) and class resolution."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, ValidationError

from splitserve.components.router.qos import QosConfig, build_estimator, resolve_class
from splitserve.contracts.validation import error_paths

from .qos_factories import config

pytestmark = pytest.mark.unit


def klass(name: str, **fields):
    """One class as it would appear in YAML."""
    return {"name": name, "ttft_ms": 1000, "tpot_ms": 100, "may_reject": False,
            "may_degrade": False, **fields}


def test_seed_section_loads_as_written():
    cfg = QosConfig.model_validate({"enable_early_rejection": True,
                                    "low_priority_threshold_ms": 500,
                                    "reject_on_slo_violation": True})
    assert [c.name for c in cfg.classes] == ["high", "default", "low"]
    assert cfg.default_class == "default" and cfg.header is None
    assert [c.may_reject for c in cfg.classes] == [False, False, True]
    assert cfg.class_named("low").may_degrade and not cfg.class_named("high").may_degrade
    assert cfg.estimate_max_age_s == 1.0


def test_build_estimator_takes_the_config_knobs():
    cfg = config(estimate_max_age_s=2.5, estimator={"smoothing": 0.5})
    estimator = build_estimator(cfg)
    assert estimator.max_age_s == 2.5 and estimator.params.smoothing == 0.5


BAD = {
    "unknown key": ({"reject_low": True}, "reject_low"),
    "default class not a class": ({"default_class": "gold"}, "default_class"),
    "default class not in custom classes": ({"classes": [klass("a")]}, "default_class"),
    "duplicate class names": ({"classes": [klass("a"), klass("a")], "default_class": "a"},
                              "classes.1.name"),
    "no classes": ({"classes": []}, "classes"),
    "upper-case class name": ({"classes": [klass("Gold")]}, "classes.0.name"),
    "zero ttft": ({"classes": [klass("a", ttft_ms=0)], "default_class": "a"},
                  "classes.0.ttft_ms"),
    "nan tpot": ({"classes": [klass("a", tpot_ms=float("nan"))], "default_class": "a"},
                 "classes.0.tpot_ms"),
    "missing ttft target": ({"classes": [{"name": "a", "tpot_ms": 1}],
                             "default_class": "a"}, "classes.0.ttft_ms"),
    "unknown mode": ({"mode": "advisory"}, "mode"),
    "unknown class key": ({"classes": [klass("a", weight=1)], "default_class": "a"},
                          "classes.0.weight"),
    "user mapped to unknown class": ({"user_map": {"alice": "gold"}}, "user_map.alice"),
    "negative slack": ({"low_priority_threshold_ms": -1}, "low_priority_threshold_ms"),
    "zero max age": ({"estimate_max_age_s": 0}, "estimate_max_age_s"),
    "smoothing above 1": ({"estimator": {"smoothing": 1.5}}, "estimator.smoothing"),
    "zero warm-up rate": ({"estimator": {"warmup_decode_ms_per_token": 0}},
                          "estimator.warmup_decode_ms_per_token"),
    "cap of zero tokens": ({"degradation": {"cap_max_tokens": {"max_tokens": 0}}},
                           "degradation.cap_max_tokens.max_tokens"),
    "kv threshold above 1": ({"degradation": {"cap_max_tokens": {"kv_usage_threshold": 85}}},
                             "degradation.cap_max_tokens.kv_usage_threshold"),
    "unknown degradation step": ({"degradation": {"shed_load": {}}}, "degradation.shed_load"),
    "zero queue threshold": (
        {"degradation": {"disable_remote_prefill_for_low_priority":
                         {"prefill_queue_depth_threshold": 0}}},
        "degradation.disable_remote_prefill_for_low_priority.prefill_queue_depth_threshold"),
    "zero adaptive floor": ({"degradation": {"adaptive_generation_limit": {"min_tokens": 0}}},
                            "degradation.adaptive_generation_limit.min_tokens"),
}


@pytest.mark.parametrize("case", BAD.values(), ids=BAD.keys())
def test_bad_config_names_the_field(case):
    document, path = case
    with pytest.raises(ValidationError) as caught:
        QosConfig.model_validate(document)
    assert path in error_paths(caught.value)


@pytest.mark.parametrize("header", ["x-priority", "x-class", ""])
def test_a_qos_header_setting_is_refused_naming_the_one_that_is_read(header):
    with pytest.raises(ValidationError) as caught:
        QosConfig.model_validate({"header": header})
    assert error_paths(caught.value) == ["header"]
    assert "qos.header is not read" in str(caught.value)
    assert "Frontend.priority_header" in str(caught.value)


def test_cross_field_messages_name_both_fields():
    with pytest.raises(ValidationError) as caught:
        QosConfig.model_validate({"default_class": "gold"})
    message = str(caught.value)
    assert "default_class 'gold'" in message and "classes[].name" in message


def test_errors_nest_under_the_section_path():
    class PolicyFile(BaseModel):
        qos: QosConfig

    with pytest.raises(ValidationError) as caught:
        PolicyFile.model_validate({"qos": {"user_map": {"bob": "gold"}}})
    assert error_paths(caught.value) == ["qos.user_map.bob"]


CFG = config(user_map={"batch-bot": "low", "vip": "high"})

RESOLVE = {
    # name: (header, user, metadata, expected name, source, reason)
    "nothing named": (None, None, None, "default", "default", "default"),
    "header": ("high", None, None, "high", "header", "header"),
    "header case and spaces": ("  HIGH ", None, None, "high", "header", "header"),
    "header beats metadata and user": ("low", "vip", {"priority": "high"}, "low", "header",
                                       "header"),
    "empty header falls through": ("", None, {"priority": "low"}, "low", "metadata",
                                   "metadata"),
    "metadata beats user": (None, "vip", {"priority": "low"}, "low", "metadata", "metadata"),
    "other metadata keys ignored": (None, None, {"team": "high"}, "default", "default",
                                    "default"),
    "user map": (None, "batch-bot", {}, "low", "user", "user-map"),
    "unmapped user": (None, "someone", None, "default", "default", "default"),
    "unknown header class": ("gold", "vip", None, "default", "header", "unknown-class"),
    "unknown metadata class": (None, None, {"priority": "urgent"}, "default", "metadata",
                               "unknown-class"),
    "non-string metadata": (None, None, {"priority": 1}, "default", "metadata",
                            "unknown-class"),
}


@pytest.mark.parametrize("case", RESOLVE.values(), ids=RESOLVE.keys())
def test_resolve_class(case):
    header, user, metadata, name, source, reason = case
    resolution = resolve_class(header, user, metadata, CFG)
    assert (resolution.name, resolution.source, resolution.reason) == (name, source, reason)


def test_resolution_keeps_the_requested_name():
    assert resolve_class("gold", None, None, CFG).requested == "gold"


def test_custom_metadata_key():
    cfg = config(metadata_key="tier")
    assert resolve_class(None, None, {"tier": "low", "priority": "high"}, cfg).name == "low"
