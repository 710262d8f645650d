"""The OpenAI request parameters Dynamo's mocker honours: none beyond what the frontend
serves itself (it simulates timing, not sampling); the frontend refuses the others by
name.  The registry names ``REQUEST_PARAMS``."""

from splitserve.contracts.engine import EngineRequestParams

REQUEST_PARAMS = EngineRequestParams(honoured=frozenset())
