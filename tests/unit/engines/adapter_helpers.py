"""Small helpers the engine adapter tests share."""

from __future__ import annotations



from splitserve.components.engines.trtllm.config import TrtllmEngineArgs
from splitserve.components.engines.trtllm.engine import TrtllmEngine
from tests.fixtures.engine_doubles import LlmApiDouble


async def deltas(it) -> list:
    """The deltas an engine stream yields, up to its finished one."""
    out = []
    async for d in it:
        out.append(d)
        if d.finished:
            break
    return out


async def collect(it) -> list[int]:
    """The token ids an engine stream yields, up to its finished delta."""
    return [t for d in await deltas(it) for t in d.token_ids]


async def started_trtllm(role: str, states: dict, **kw) -> TrtllmEngine:
    """A started TensorRT-LLM adapter in ``role`` over the LLM double (``states`` is the
    doubles' shared record of requests); ``kw``: TrtllmEngineArgs fields."""
    eng = TrtllmEngine(TrtllmEngineArgs(**kw), "m", role,  # type: ignore[arg-type]
                       api_factory=lambda: LlmApiDouble(role, states))
    await eng.start()
    return eng
