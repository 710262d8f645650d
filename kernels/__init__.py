"""KV-movement kernels for disaggregated prefill/decode (imported as ``splitserve.kernels``).

* ``kv_pack``   - gather a request's KV blocks into one payload, scatter it back; token ranges.
* ``kv_layout`` - head resharding between tensor-parallel degrees; block-size re-chunking.
* ``kv_fp8``    - FP8 e4m3 compression of a payload with per-(block, layer, K/V) scales.
* ``kv_pack_fp8`` - pack and FP8-compress in one pass (the compressed staged transfer).
* ``dispatch``  - the Triton-or-torch rule every wrapper follows.

Each kernel module holds a ``@triton.jit`` kernel, a torch wrapper and a torch reference.
Nothing is imported here: Triton fixes interpreted-or-compiled when it is first imported,
so importing it is left to the modules that need it.
"""
