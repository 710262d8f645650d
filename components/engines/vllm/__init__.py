"""vLLM behind the project's engine interface (see docs/engines.md).

Nothing here imports vLLM at module import time; the engine, config mapping and KV
relay import it when they are used, so configs validate without vLLM installed.
"""
