"""One folder per engine (torch_cpu, mocker, vllm, sglang, trtllm) with its sections,
adapter and quirks; beside them the engine interface and what every engine shares."""
