"""Policy versions are signed by the operator's key and checked before they apply."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from splitserve.components.policy import PolicyKey, PolicyStore, PolicyVersion, canonical_dict, policy_sha256
from splitserve.contracts.kit.credentials import write_secret
from tests.unit.policy.policy_factories import edited, seed

pytestmark = pytest.mark.unit

KEY = PolicyKey(b"k" * 32)
OTHER = PolicyKey(b"o" * 32)
NS = "prod"


def version(**changes) -> PolicyVersion:
    from splitserve.components.policy import parse_policy

    policy = parse_policy(seed(), "seed")
    fields = {"version": 3, "created_at": datetime(2026, 1, 2, tzinfo=UTC), "source": "p.yaml",
              "author": "alice", "sha256": policy_sha256(policy), "rollback_of": None,
              "policy": canonical_dict(policy)}
    return PolicyVersion(**{**fields, **changes})


def signed(**changes) -> PolicyVersion:
    record = version(**changes)
    record.signature = KEY.sign(NS, record)
    return record


def test_a_signed_version_verifies():
    assert KEY.check(NS, signed()) is None


def test_unsigned_and_foreign_signatures_are_refused():
    assert "unsigned" in KEY.check(NS, version())
    foreign = version()
    foreign.signature = OTHER.sign(NS, foreign)
    assert "does not verify" in KEY.check(NS, foreign)
    garbage = version(signature="hmac-sha256:" + "0" * 64)
    assert "does not verify" in KEY.check(NS, garbage)


@pytest.mark.parametrize("field,value", [("version", 4), ("author", "mallory"),
                                         ("source", "other.yaml"), ("rollback_of", 1),
                                         ("sha256", "0" * 64),
                                         ("created_at", datetime(2026, 1, 3, tzinfo=UTC))])
def test_changing_any_signed_field_breaks_the_signature(field, value):
    record = signed()
    tampered = record.model_copy(update={field: value})
    assert "does not verify" in KEY.check(NS, tampered)


def test_a_signature_does_not_carry_over_to_another_namespace():
    assert "does not verify" in KEY.check("staging", signed())


def test_the_store_refuses_content_that_does_not_match_the_signed_hash():
    from splitserve.components.policy import parse_policy

    store = PolicyStore("http://127.0.0.1:1", NS, signing_key=KEY)
    record = signed()
    assert store.authenticity(record, store.parse(record)) is None
    other = parse_policy(edited(seed(), "split_policy.prompt_length_threshold", 4096), "x")
    swapped = record.model_copy(update={"policy": canonical_dict(other)})
    assert "does not match" in store.authenticity(swapped, store.parse(swapped))


def test_a_store_without_a_key_refuses_everything():
    store = PolicyStore("http://127.0.0.1:1", NS)
    record = signed()
    assert "no policy key" in store.authenticity(record, store.parse(record))


def test_keys_come_from_private_files_only(tmp_path):
    path = tmp_path / "policy.key"
    write_secret(path)
    key = PolicyKey.from_file(path)
    assert key.check(NS, signed()) is not None  # a different random key
    path.chmod(0o640)
    with pytest.raises(PermissionError):
        PolicyKey.from_file(path)
    with pytest.raises(ValueError):
        PolicyKey(b"short")


def test_cli_refuses_a_key_file_others_can_read(tmp_path):
    from typer.testing import CliRunner

    from splitserve.cli.main import app
    from tests.unit.policy.policy_factories import CONFIGS

    key = tmp_path / "policy.key"
    write_secret(key)
    key.chmod(0o644)
    res = CliRunner().invoke(app, ["policy", "apply", str(CONFIGS / "policies" / "seed.yaml"),
                                   "--etcd", "http://u:pw@127.0.0.1:1", "--namespace", "x",
                                   "--key-file", str(key)])
    assert res.exit_code == 2
    assert "error: cannot use policy key" in res.output and "chmod 600" in res.output
    assert "[red]" not in res.output
