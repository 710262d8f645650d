"""Compile the KV kernels for Hopper (sm_90) without a GPU and print, as JSON, the global
memory and division instructions each PTX uses.  Run by ``test_sm90_code.py`` in its own
process: Triton must be imported in compiled mode, not under the interpreter."""

from __future__ import annotations

import json
import re

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from splitserve.kernels import kv_fp8, kv_layout, kv_pack, kv_pack_fp8

ALIGNED = [["tt.divisibility", 16]]


def ptx_ops(kernel, signature: dict, constexprs: dict, aligned: list[str]) -> list[str]:
    """The distinct ld/st.global and div instructions of ``kernel`` compiled for sm_90,
    with the arguments named in ``aligned`` known to be multiples of 16 (as Triton
    specialises 16-byte aligned pointers and integers divisible by 16)."""
    names = list(signature)
    signature = {**signature, **{name: "constexpr" for name in constexprs}}
    attrs = {(names.index(a),): ALIGNED for a in aligned}
    src = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options={"enable_fp_fusion": False})
    return sorted(set(re.findall(r"(?:ld|st)\.global[.\w]*|div\.[\w.]+", compiled.asm["ptx"])))


def main() -> None:
    words = {"pool_ptr": "*i32", "payload_ptr": "*i32", "ids_ptr": "*i64"}
    report = {
        "pack": ptx_ops(kv_pack._blocks_kernel, {**words, "num_rows": "i32", "row_units": "i32"},
                        {"GATHER": True, "VEC": 4, "BLOCK": 4096},
                        ["pool_ptr", "payload_ptr", "ids_ptr", "row_units"]),
        "unpack": ptx_ops(kv_pack._blocks_kernel, {**words, "num_rows": "i32", "row_units": "i32"},
                          {"GATHER": False, "VEC": 4, "BLOCK": 4096},
                          ["pool_ptr", "payload_ptr", "ids_ptr", "row_units"]),
        "tokens": ptx_ops(kv_pack._tokens_kernel, {
            **words, **{k: "i32" for k in ("num_rows", "num_tokens", "token_start", "layer_start",
                                            "num_layers", "block_size", "row_units")}},
            {"GATHER": True, "VEC": 4, "BLOCK_R": 32, "BLOCK_C": 128},
            ["pool_ptr", "payload_ptr", "ids_ptr", "block_size", "row_units"]),
        "head_copy": ptx_ops(kv_layout._head_copy_kernel, {
            "src_ptr": "*i32", "dst_ptr": "*i32", **{k: "i32" for k in (
                "num_rows", "src_row_units", "dst_row_units", "src_col0", "dst_col0",
                "num_cols")}}, {"VEC": 4, "BLOCK_R": 64, "BLOCK_C": 64},
            ["src_ptr", "dst_ptr", "src_row_units", "dst_row_units", "num_cols"]),
        "rechunk": ptx_ops(kv_layout._rechunk_kernel, {
            "src_ptr": "*i32", "dst_ptr": "*i32", **{k: "i32" for k in (
                "num_rows", "num_tokens", "num_lk", "bs_in", "bs_out", "row_units")}},
            {"VEC": 4, "BLOCK_R": 32, "BLOCK_C": 128}, ["src_ptr", "dst_ptr", "row_units"]),
        "compress": ptx_ops(kv_fp8._compress_kernel, {
            "x_ptr": "*bf16", "q_ptr": "*u8", "scale_ptr": "*fp32", "group_numel": "i32"},
            {"BLOCK": 4096}, ["x_ptr", "q_ptr", "scale_ptr", "group_numel"]),
        "decompress": ptx_ops(kv_fp8._decompress_kernel, {
            "q_ptr": "*u8", "scale_ptr": "*fp32", "out_ptr": "*bf16", "group_numel": "i32"},
            {"OUT_BF16": True, "BLOCK": 4096}, ["q_ptr", "scale_ptr", "out_ptr", "group_numel"]),
        "pack_compress": ptx_ops(kv_pack_fp8._pack_compress_kernel, {
            "pool_ptr": "*bf16", "ids_ptr": "*i64", "q_ptr": "*u8", "scale_ptr": "*fp32",
            "num_groups": "i32", "slabs": "i32", "group_numel": "i32"},
            {"BLOCK": 4096}, ["pool_ptr", "ids_ptr", "q_ptr", "scale_ptr", "group_numel"]),
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
