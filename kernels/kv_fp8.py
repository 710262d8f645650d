"""FP8 (e4m3fn) compression of a KV payload, an option of the transfer.

The transfer layer calls :func:`compress` on the prefill side before sending and
:func:`decompress` on the decode side after receiving; the pair halves (bf16) or quarters
(fp32) the bytes on the wire.

**Scale granularity: one fp32 scale per (block, layer, K/V)**, i.e. per ``[B, H, D]`` slab
of a ``[n, L, 2, B, H, D]`` payload (``group_ndim=3``), so every slab meets the error
bound relative to its own amax.  K and V differ in magnitude, and so do layers (a few carry
far larger activations); one scale per block is set by the loudest slab, and once a slab
is ~1e4 times quieter its values fall into e4m3's coarse subnormal range (rms error 2.6 %
-> 5 % at 1e4, 51 % at 1e5; see docs/results/kernels.md).  The slab is 3072 elements for
the served model, so the scales cost 4 bytes per 3072 (0.13 %).  ``group_ndim`` picks another granularity (1: per block; 2 for
a ``[L', 2, T, H, D]`` token payload: per layer and K/V).

**Error bound** with ``s = amax / 448`` of a group: every element satisfies
``|x_hat - x| <= max(|x| / 16, s / 1024)``, so ``|x_hat - x| <= amax / 28`` for fp32
(:func:`error_bound`); decompressing to bf16/fp16 adds that dtype's rounding of ``x_hat``
(bound ``amax / 25.2`` for bf16, ``amax / 27.6`` for fp16).

**Why the kernels encode e4m3 by hand.**  Triton's interpreter rounds fp32 -> fp8 wrongly
when the mantissa carries into the exponent (31.76 becomes 16, not 32) and fp32 -> bf16
wrongly as well, so the kernels round with integer operations (round-to-nearest-even, the
same as ``tensor.to(torch.float8_e4m3fn)``), which the interpreter and the GPU run alike.
Codes are stored as uint8 bit patterns; ``data.view(torch.float8_e4m3fn)`` reinterprets them.
NaN and inf inputs are not supported.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .dispatch import LAUNCH_OPTIONS, Backend, launchable, resolve_backend

FP8_MAX = 448.0
# Largest scale group (elements) a program holds in registers to read it only once; the
# served model's (block, layer, K/V) slab is 16*3*64 = 3072 elements.
SINGLE_PASS_MAX = 4096
_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class Fp8Payload(NamedTuple):
    """What :func:`compress` returns and the transfer sends: e4m3fn codes with the
    payload's shape, and fp32 scales with shape ``payload.shape[:group_ndim]``."""

    data: torch.Tensor    # uint8, payload.shape
    scales: torch.Tensor  # float32, payload.shape[:group_ndim]


@triton.jit
def e4m3_bits(y):
    """e4m3fn bit patterns (int32, 0..255) of fp32 values ``y`` already divided by their
    scale; round to nearest even and saturate at +-448, as ``tensor.to(float8_e4m3fn)``
    after a clamp.  Shared by the compress and the fused pack+compress kernels."""
    sign = (y.to(tl.int32, bitcast=True) >> 24) & 0x80
    bits = tl.minimum(tl.abs(y), 448.0).to(tl.int32, bitcast=True)
    exp = (bits >> 23) - 127                       # unbiased fp32 exponent
    man = (bits & 0x7FFFFF) | 0x800000             # 24-bit significand
    # e4m3 keeps 3 fraction bits for exp >= -6, and steps of 2**-9 below (subnormals)
    shift = tl.minimum(tl.maximum(14 - exp, 20), 25)
    q = man >> shift
    rem = man & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    q += ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(tl.int32)
    # a rounding carry (q == 16) lands on the next exponent by itself
    return (tl.maximum(exp + 6, 0) * 8 + q) | sign


@triton.jit
def group_scale(amax):
    """``amax / 448`` correctly rounded (``div_rn``: Triton's ``/`` is approximate on
    CUDA), or 1.0 for an all-zero group."""
    scale = tl.div_rn(amax, 448.0)
    return tl.where(scale > 0, scale, 1.0)


@triton.jit
def _compress_kernel(
    x_ptr,          # *T   [G, S]: payload, one scale group per row
    q_ptr,          # *u8  [G, S]: e4m3fn bit patterns
    scale_ptr,      # *f32 [G]: amax / 448 of the group (1.0 if the group is all zero)
    group_numel,    # S
    BLOCK: tl.constexpr,   # elements per inner step; >= S means one pass from registers
):
    base = tl.program_id(0).to(tl.int64) * group_numel
    offs = tl.arange(0, BLOCK)
    if BLOCK >= group_numel:                           # the group fits: read it once
        mask = offs < group_numel
        x = tl.load(x_ptr + base + offs, mask=mask, other=0).to(tl.float32)
        scale = group_scale(tl.max(tl.abs(x), axis=0))
        tl.store(scale_ptr + tl.program_id(0), scale)
        tl.store(q_ptr + base + offs, e4m3_bits(tl.div_rn(x, scale)).to(tl.uint8), mask=mask)
    else:
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, group_numel, BLOCK):    # pass 1: amax of the group
            mask = start + offs < group_numel
            x = tl.load(x_ptr + base + start + offs, mask=mask, other=0).to(tl.float32)
            acc = tl.maximum(acc, tl.abs(x))
        scale = group_scale(tl.max(acc, axis=0))
        tl.store(scale_ptr + tl.program_id(0), scale)
        for start in range(0, group_numel, BLOCK):    # pass 2: quantise
            mask = start + offs < group_numel
            x = tl.load(x_ptr + base + start + offs, mask=mask, other=0).to(tl.float32)
            tl.store(q_ptr + base + start + offs,
                     e4m3_bits(tl.div_rn(x, scale)).to(tl.uint8), mask=mask)


@triton.jit
def _decompress_kernel(
    q_ptr,          # *u8  [G, S]: e4m3fn bit patterns
    scale_ptr,      # *f32 [G]
    out_ptr,        # *T   [G, S]: T is fp32, fp16 or bf16
    group_numel,    # S
    OUT_BF16: tl.constexpr,  # round to bf16 by hand (see the module docstring)
    BLOCK: tl.constexpr,     # elements per program
):
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < group_numel
    base = tl.program_id(0).to(tl.int64) * group_numel
    code = tl.load(q_ptr + base + offs, mask=mask, other=0).to(tl.int32)
    exp = (code >> 3) & 15
    man = code & 7
    normal = (((exp + 120) << 23) | (man << 20)).to(tl.float32, bitcast=True)
    val = tl.where(exp > 0, normal, man.to(tl.float32) * 0.001953125)     # 2**-9
    val = tl.where(code >= 128, -val, val)
    y = val * tl.load(scale_ptr + tl.program_id(0))
    if OUT_BF16:
        b = y.to(tl.int32, bitcast=True)
        b = b + 0x7FFF + ((b >> 16) & 1)
        tl.store(out_ptr + base + offs, (b >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True),
                 mask=mask)
    else:
        tl.store(out_ptr + base + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------- torch references

def _groups(shape: torch.Size, group_ndim: int) -> tuple[int, int]:
    if not 0 <= group_ndim <= len(shape):
        raise ValueError(f"group_ndim {group_ndim} does not fit shape {tuple(shape)}")
    num_groups = shape[:group_ndim].numel()
    return num_groups, (shape.numel() // num_groups if num_groups else 0)


def compress_ref(payload: torch.Tensor, group_ndim: int = 3) -> Fp8Payload:
    """Torch reference of :func:`compress`."""
    num_groups, group_numel = _groups(payload.shape, group_ndim)
    x = payload.reshape(num_groups, group_numel).float()
    amax = x.abs().amax(dim=1) if group_numel else x.new_zeros(num_groups)
    # Tensor by tensor: torch on CUDA turns a division by a Python number into a
    # multiplication by its reciprocal, one ulp off in about half the groups; a tensor
    # divisor is divided correctly rounded on every device, as the kernels' div_rn.
    scale = amax / torch.full_like(amax, FP8_MAX)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    y = (x / scale[:, None]).clamp(-FP8_MAX, FP8_MAX)
    data = y.to(torch.float8_e4m3fn).view(torch.uint8).reshape(payload.shape)
    return Fp8Payload(data, scale.reshape(payload.shape[:group_ndim]))


def decompress_ref(data: torch.Tensor, scales: torch.Tensor,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Torch reference of :func:`decompress`."""
    vals = data.view(torch.float8_e4m3fn).float().reshape(scales.numel(), -1)
    return (vals * scales.reshape(-1, 1)).to(dtype).reshape(data.shape)


def error_bound(scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Largest absolute round-trip error per group, for decompression to ``dtype``.

    e4m3 steps are at most 32 below 448 (between 256 and 448), so rounding moves a scaled
    value by at most 16: ``16 * s = amax / 28``.  A bf16/fp16 result adds half an ulp of
    ``|x_hat| <= 448 * s``: unit roundoff 2**-8 (bf16) or 2**-11 (fp16).
    """
    roundoff = {torch.float32: 0.0, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[dtype]
    return (16.0 + FP8_MAX * roundoff) * scales


# ---------------------------------------------------------------- wrappers

def group_block(group_numel: int) -> int:
    """Elements a compress program handles per step: the whole group (one read, from
    registers) up to :data:`SINGLE_PASS_MAX` elements, else 1024 (two reads)."""
    whole = triton.next_power_of_2(max(group_numel, 16))
    return whole if whole <= SINGLE_PASS_MAX else 1024


def compress(payload: torch.Tensor, *, group_ndim: int = 3, out: Fp8Payload | None = None,
             block: int | None = None, backend: Backend | None = None) -> Fp8Payload:
    """Called by the sender before a compressed transfer; returns the codes (uint8, the
    payload's shape) and one fp32 scale per group (``payload.shape[:group_ndim]``), in
    ``out``'s tensors when given (e.g. registered send buffers)."""
    if payload.dtype not in _OUT_DTYPES:
        raise ValueError(f"payload dtype must be one of {_OUT_DTYPES}, got {payload.dtype}")
    num_groups, group_numel = _groups(payload.shape, group_ndim)
    if out is None:
        out = Fp8Payload(
            torch.empty(payload.shape, dtype=torch.uint8, device=payload.device),
            torch.empty(payload.shape[:group_ndim], dtype=torch.float32, device=payload.device))
    elif (out.data.shape != payload.shape or out.data.dtype != torch.uint8
          or out.scales.shape != payload.shape[:group_ndim] or out.scales.dtype != torch.float32
          or not (out.data.is_contiguous() and out.scales.is_contiguous())):
        raise ValueError("out must hold contiguous uint8 codes shaped like the payload and "
                         "fp32 scales shaped like payload.shape[:group_ndim]")
    if resolve_backend(payload, backend) == "torch" or not group_numel:
        ref = compress_ref(payload, group_ndim)
        out.data.copy_(ref.data)
        out.scales.copy_(ref.scales)
        return out
    launchable(_compress_kernel, payload.device)[(num_groups,)](
        payload.contiguous(), out.data, out.scales, group_numel,
        BLOCK=block or group_block(group_numel), **LAUNCH_OPTIONS)
    return out


def decompress(data: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32,
               *, out: torch.Tensor | None = None, block: int | None = None,
               backend: Backend | None = None) -> torch.Tensor:
    """Called by the receiver after a compressed transfer; returns the payload in
    ``dtype`` (``out`` when given, e.g. a buffer about to be unpacked into the pool)."""
    if data.dtype != torch.uint8 or scales.dtype != torch.float32:
        raise ValueError(f"need uint8 codes and fp32 scales, got {data.dtype}, {scales.dtype}")
    group_ndim = scales.dim()
    if data.shape[:group_ndim] != scales.shape or dtype not in _OUT_DTYPES:
        raise ValueError(f"scales {tuple(scales.shape)} must lead data {tuple(data.shape)}; "
                         f"dtype one of {_OUT_DTYPES}")
    if out is None:
        out = torch.empty(data.shape, dtype=dtype, device=data.device)
    elif out.shape != data.shape or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(f"out must be contiguous {tuple(data.shape)} {dtype}")
    num_groups, group_numel = _groups(data.shape, group_ndim)
    if resolve_backend(data, backend) == "torch" or not group_numel:
        return out.copy_(decompress_ref(data, scales, dtype))
    block = block or min(triton.next_power_of_2(max(group_numel, 16)), SINGLE_PASS_MAX)
    grid = (num_groups, triton.cdiv(group_numel, block))
    launchable(_decompress_kernel, data.device)[grid](
        data.contiguous(), scales.contiguous(), out, group_numel,
        OUT_BF16=dtype == torch.bfloat16, BLOCK=block, **LAUNCH_OPTIONS)
    return out
