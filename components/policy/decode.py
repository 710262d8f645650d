"""Decoding policy documents from YAML or JSON, refusing duplicate keys.

Both PyYAML and ``json`` keep the last of two equal keys without a word; in a policy
file that hides an edit, so both decoders here refuse them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from splitserve.contracts.config import yaml_problem

SUFFIXES = {".yaml": "yaml", ".yml": "yaml", ".json": "json"}


class DocumentError(ValueError):
    """The file cannot be read or decoded; the message says where and why."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that raises on a repeated key in a mapping."""

    def construct_mapping(self, node, deep=False):
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise DocumentError(f"duplicate key {key!r}")
        out[key] = value
    return out


def decode_text(text: str, kind: str) -> Any:
    """Decode ``text`` as ``"yaml"`` or ``"json"``; raises ``DocumentError``."""
    try:
        if kind == "json":
            return json.loads(text, object_pairs_hook=_unique_pairs)
        return yaml.load(text, Loader=_UniqueKeyLoader)
    except json.JSONDecodeError as exc:
        raise DocumentError(f"invalid JSON: {exc}") from None
    except yaml.YAMLError as exc:
        raise DocumentError(f"invalid YAML: {yaml_problem(exc)}") from None


def decode_document(path: Path) -> Any:
    """Read ``path`` and decode it by its suffix; raises ``DocumentError``."""
    kind = SUFFIXES.get(path.suffix.lower())
    if kind is None:
        raise DocumentError(f"unsupported file type {path.suffix!r}; use "
                            f"{', '.join(SUFFIXES)}")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise DocumentError(f"cannot read: {exc}") from None
    return decode_text(text, kind)
