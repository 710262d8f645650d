"""splitserve: disaggregated prefill/decode LLM serving on NVIDIA Dynamo's runtime."""

__version__ = "0.1.0"
