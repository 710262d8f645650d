"""A fake engine whose LoRA members behave as ``contracts.engine.Engine`` says they do:
``load_lora`` raises ValueError naming what is wrong (no adapter_config.json, no slot
left) and is a no-op for a name already loaded from the same path; ``unload_lora``
raises KeyError for a name not loaded and ValueError while requests use it; ``validate``
refuses an adapter that is not loaded.  Shared by the worker's LoRA tests."""

from __future__ import annotations

from pathlib import Path

from splitserve.contracts.engine import (
    EngineCapabilities,
    EngineInfo,
    GenerateParams,
    LoadSample,
    TokenDelta,
)

ADAPTER_CONFIG = '{"peft_type": "LORA", "r": 8, "target_modules": ["q_proj"]}'


def adapter_dir(root: Path, name: str) -> Path:
    """A directory that passes for a PEFT adapter (its adapter_config.json)."""
    path = root / name
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(ADAPTER_CONFIG)
    return path


class FakeLoraEngine:
    """Loads adapters into ``slots`` slots; ``busy[name]`` counts its requests in flight."""

    def __init__(self, serves: bool = True, slots: int = 4, name: str = "fake") -> None:
        caps = EngineCapabilities(local_prefill=True, pushes_kv=False,
                                  handoff_before_prefill=False, prefix_lookup=False,
                                  moves_kv=False, reports_failure=False, serves_lora=serves)
        self.info = EngineInfo(name, 16, caps)
        self.slots = slots
        self.loaded: dict[str, str] = {}
        self.busy: dict[str, int] = {}
        self.calls: list[tuple[str, str]] = []

    async def load_lora(self, name: str, path: str) -> None:
        self.calls.append(("load", name))
        if self.loaded.get(name) == path:
            return
        if not (Path(path) / "adapter_config.json").is_file():
            raise ValueError(f"{path}: no adapter_config.json")
        if name not in self.loaded and len(self.loaded) >= self.slots:
            raise ValueError(f"no LoRA slot left ({self.slots} loaded)")
        self.loaded[name] = path

    async def unload_lora(self, name: str) -> None:
        self.calls.append(("unload", name))
        if name not in self.loaded:
            raise KeyError(name)
        if self.busy.get(name):
            raise ValueError(f"{self.busy[name]} requests use {name}")
        del self.loaded[name]

    def loras(self) -> dict[str, str]:
        return dict(self.loaded)

    def validate(self, params: GenerateParams) -> None:
        if params.lora is not None and params.lora not in self.loaded:
            raise ValueError(f"the LoRA adapter '{params.lora}' is not loaded")

    async def generate(self, request_id: str, params: GenerateParams):
        yield TokenDelta((len(params.lora or ""),), True, None, len(params.token_ids), 0)

    def load(self) -> LoadSample:
        return LoadSample(0, 0, 0, 100)

    def inflight(self) -> int:
        return 0
