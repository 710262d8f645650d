"""Which engines a Worker can run, and the module that runs each."""

from __future__ import annotations

from splitserve.serve.config import ComponentConfig

from .config import TorchWorkerConfig


def engine_choices() -> dict[str, type[ComponentConfig]]:
    """Engine name → the Worker section's config model for that engine."""
    from splitserve.components.engines.sglang.sections import SglangWorkerSection
    from splitserve.components.engines.trtllm.sections import TrtllmWorkerSection
    from splitserve.components.engines.vllm.config import VllmWorkerSection

    from .mocker import MockerWorkerSection

    return {"torch": TorchWorkerConfig, "mocker": MockerWorkerSection,
            "vllm": VllmWorkerSection, "sglang": SglangWorkerSection,
            "trtllm": TrtllmWorkerSection}
