"""LoRA adapters on the vLLM engine: which are loaded, the integer id vLLM knows each by,
and how many requests use each now.

vLLM identifies an adapter by ``LoRARequest.lora_int_id`` and keys its prefix cache by
name and path; every request that uses one carries the whole ``LoRARequest``, so vLLM can
load it again after evicting it from its host cache (``max_cpu_loras``).  Ids are stable
per name for the engine's life: unloading and loading a name again reuses its id.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager


class UnknownAdapter(ValueError):
    """A request named an adapter that is not loaded on this engine."""


class LoraTable:
    """The adapters one vLLM engine serves: name -> (id, path), and their users."""

    def __init__(self) -> None:
        self._ids: dict[str, int] = {}
        self._paths: dict[str, str] = {}
        self._users: Counter[str] = Counter()

    def paths(self) -> dict[str, str]:
        """Loaded adapters: name -> the directory each was loaded from."""
        return dict(self._paths)

    def path_of(self, name: str) -> str | None:
        return self._paths.get(name)

    def id_of(self, name: str) -> int:
        """The adapter's id, the same every time ``name`` is loaded (vLLM's ids start at
        1)."""
        return self._ids.setdefault(name, len(self._ids) + 1)

    def build(self, name: str, path: str):
        """vLLM's ``LoRARequest`` for ``name`` at ``path``."""
        from vllm.lora.request import LoRARequest

        return LoRARequest(lora_name=name, lora_int_id=self.id_of(name), lora_path=path)

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
        """Refuse a request naming an adapter that is not loaded."""
        if name is not None and name not in self._paths:
            raise UnknownAdapter(f"lora: adapter {name!r} is not loaded on this vLLM engine "
                                 f"(loaded: {sorted(self._paths)})")

    @contextmanager
    def using(self, name: str | None) -> Iterator[object | None]:
        """The ``LoRARequest`` of a request naming adapter ``name`` (None: the base
        model), counted as in use until the block ends."""
        if name is None:
            yield None
            return
        self.check(name)
        self._users[name] += 1
        try:
            yield self.build(name, self._paths[name])
        finally:
            self._users[name] -= 1
            if not self._users[name]:
                del self._users[name]


def adapter_path(path: str) -> str:
    """An adapter directory as the table keeps it: absolute, so loading the same
    directory again by another spelling is the same load."""
    return os.path.abspath(path)


def check_adapter_dir(path: str, lora_config) -> None:
    """Refuse an adapter directory vLLM would refuse, before it is sent to the engine
    process: no ``adapter_config.json`` (vLLM would try the hub), or a config vLLM's own
    ``PEFTHelper`` rejects against the engine's ``LoRAConfig`` (a rank over
    ``max_lora_rank``, bias, unsupported features).  Raises ValueError naming both."""
    from vllm.lora.peft_helper import PEFTHelper

    if not os.path.isfile(os.path.join(path, "adapter_config.json")):
        raise ValueError(f"{path}: no adapter_config.json there (a PEFT adapter directory "
                         "is needed; nothing is downloaded)")
    try:
        PEFTHelper.from_local_dir(path, None).validate_legal(lora_config)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{path}: vLLM refuses the adapter: {exc}") from None
