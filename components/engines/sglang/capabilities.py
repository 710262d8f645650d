"""The OpenAI request parameters the SGLang engine honours (the registry names
``REQUEST_PARAMS``; the frontend refuses the others by name).  Two need the engine
started for them, or the worker refuses the request (``SglangEngine.validate``)."""

from splitserve.contracts.engine import EngineRequestParams

REQUEST_PARAMS = EngineRequestParams(
    honoured=frozenset({
        "seed", "presence_penalty", "frequency_penalty", "repetition_penalty", "top_k",
        "min_p", "min_tokens", "logit_bias", "logprobs", "top_logprobs", "response_format",
        "tool_choice"}),
    notes={"seed": "SGLang only with deterministic_inference (refused by the worker "
                   "otherwise)",
           "response_format": "SGLang: its json_schema, with engine_args.structured_output "
                              "(refused by the worker otherwise)"})
