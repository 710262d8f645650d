"""The OpenAI request parameters the vLLM engine honours (the registry names
``REQUEST_PARAMS``; the frontend refuses the others by name)."""

from splitserve.contracts.engine import EngineRequestParams

REQUEST_PARAMS = EngineRequestParams(
    honoured=frozenset({
        "seed", "presence_penalty", "frequency_penalty", "repetition_penalty", "top_k",
        "min_p", "min_tokens", "logit_bias", "logprobs", "top_logprobs", "response_format",
        "tool_choice"}),
    notes={"response_format": "vLLM: its structured outputs"})
