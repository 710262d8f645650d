"""LoRA adapters on the SGLang engine: which are loaded and how many requests use each.

SGLang keys its adapters by name (its registry, ``lora_ref_cache``): a request names its
adapter in ``lora_path`` (despite the word, the name), as Dynamo's SGLang worker sends
it.  SGLang's own unload waits for the adapter's requests; this table refuses instead,
as the engine contract says.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager


class UnknownAdapter(ValueError):
    """A request named an adapter that is not loaded on this engine."""


class LoraTable:
    """The adapters one SGLang engine serves: name -> path, and their users."""

    def __init__(self, preloaded: dict[str, str] | None = None) -> None:
        self._paths: dict[str, str] = dict(preloaded or {})
        self._users: Counter[str] = Counter()

    def paths(self) -> dict[str, str]:
        return dict(self._paths)

    def path_of(self, name: str) -> str | None:
        return self._paths.get(name)

    def add(self, name: str, path: str) -> None:
        self._paths[name] = path

    def remove(self, name: str) -> str:
        """Forget ``name`` (KeyError when it is not loaded; ValueError while requests use
        it); returns its path."""
        if name not in self._paths:
            raise KeyError(f"LoRA adapter {name!r} is not loaded (loaded: "
                           f"{sorted(self._paths)})")
        if self._users[name]:
            raise ValueError(f"LoRA adapter {name!r} is used by {self._users[name]} "
                             "request(s) in flight; unload it once they finish")
        return self._paths.pop(name)

    def check(self, name: str | None) -> None:
        if name is not None and name not in self._paths:
            raise UnknownAdapter(f"lora: adapter {name!r} is not loaded on this SGLang "
                                 f"engine (loaded: {sorted(self._paths)})")

    def acquire(self, name: str | None) -> None:
        """Count a request that uses ``name`` (None: the base model, not counted)."""
        if name is not None:
            self.check(name)
            self._users[name] += 1

    def release(self, name: str | None) -> None:
        if name is not None and self._users[name]:
            self._users[name] -= 1
            if not self._users[name]:
                del self._users[name]

    @contextmanager
    def using(self, name: str | None) -> Iterator[None]:
        """``name`` counted as in use until the block ends."""
        self.acquire(name)
        try:
            yield
        finally:
            self.release(name)


def adapter_path(path: str) -> str:
    """An adapter directory as the table keeps it: absolute, so loading the same
    directory again by another spelling is the same load."""
    return os.path.abspath(path)


def check_adapter_dir(path: str) -> None:
    """Refuse a path that holds no ``adapter_config.json``: SGLang would look it up on
    the hub instead, and nothing is downloaded here."""
    if not os.path.isfile(os.path.join(path, "adapter_config.json")):
        raise ValueError(f"{path}: no adapter_config.json there (a PEFT adapter directory "
                         "is needed; nothing is downloaded)")
