"""The OpenAI request parameters the TensorRT-LLM engine honours (the registry names
``REQUEST_PARAMS``; the frontend refuses the others by name): all but ``logit_bias``.
The worker also refuses prompt log-probabilities and, without a guided-decoding backend,
JSON schemas (``TrtllmEngine.validate``)."""

from splitserve.contracts.engine import EngineRequestParams

REQUEST_PARAMS = EngineRequestParams(
    honoured=frozenset({
        "seed", "presence_penalty", "frequency_penalty", "repetition_penalty", "top_k",
        "min_p", "min_tokens", "logprobs", "top_logprobs", "response_format",
        "tool_choice"}),
    notes={"echo": "TensorRT-LLM workers refuse echo with logprobs (no prompt "
                   "log-probabilities)",
           "response_format": "TensorRT-LLM: GuidedDecodingParams, with "
                              "engine_args.guided_decoding_backend (refused by the worker "
                              "otherwise)"})
