"""Throughput of the KV-movement kernels against a plain copy of the same bytes.

Per payload size this times, each as GB/s and as a fraction of a copy:

* ``copy``           ``dst.copy_(src)`` of the payload's bytes: the practical ceiling;
* ``index_select``   ``torch.index_select`` of the same blocks (torch's gather);
* ``index_copy``     ``pool.index_copy_`` (torch's scatter);
* ``pack``/``unpack`` the automatic path (``backend`` says which one the dispatch took);
* ``pack_triton``/``unpack_triton`` the Triton kernel forced;
* ``pack_fp8``       the fused pack + FP8 compress of the compressed transfer;
* ``pack_then_fp8``  the two passes it replaces, ``compress(kv_pack(...))``;
* ``fp8_compress``/``fp8_decompress`` on a packed payload.

Every row counts the payload's bytes in its own dtype (bf16 on a GPU), so ``vs_copy`` of
the FP8 rows is a fraction of a copy of the uncompressed payload, and ``vs_index_select``
compares pack with torch's gather.  Throughput is from the fastest of repeated calls (the
median is kept too).

Block geometry is the served model's: block_size 16, 3 KV heads, head_dim 64.  Payloads of
4 blocks or more use whole 30-layer blocks; smaller ones use one-layer blocks (the unit of
layer-wise streaming), gathered from a shuffled block table twice the payload's size.

    python benchmarks/bench_kernels.py --device cuda    # compiled kernels, bf16
    python benchmarks/bench_kernels.py                  # CPU: torch paths, 1 thread
    python benchmarks/bench_kernels.py --interpret      # CPU: the kernels interpreted, tiny

Results go to ``benchmarks/results/kernels_<gpu name>.json`` (``kernels_cpu.json``,
``kernels_cpu_interpret.json`` on a CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

BLOCK_SIZE, HEADS, HEAD_DIM, LAYERS = 16, 3, 64, 30
MIB = 1 << 20
SIZES = {"cuda": [MIB // 4, MIB, 4 * MIB, 16 * MIB, 64 * MIB, 256 * MIB, 1024 * MIB],
         "cpu": [64 << 10, 256 << 10, MIB, 4 * MIB, 16 * MIB, 64 * MIB],
         "interpret": [16 << 10, 48 << 10]}
RESULTS = Path(__file__).parent / "results"


def geometry(target_bytes: int, elem_bytes: int) -> tuple[int, int]:
    """(blocks, layers per block) whose payload is closest to ``target_bytes``."""
    layer_bytes = 2 * BLOCK_SIZE * HEADS * HEAD_DIM * elem_bytes
    layers = LAYERS if target_bytes >= 4 * LAYERS * layer_bytes else 1
    return max(1, round(target_bytes / (layers * layer_bytes))), layers


def timer(device, min_calls: int, min_seconds: float) -> Callable[[Callable[[], object]], list]:
    """Returns a function giving the seconds of repeated calls of ``fn``."""
    import torch

    def cpu(fn):
        fn()
        times, start = [], time.perf_counter()
        while len(times) < min_calls or time.perf_counter() - start < min_seconds:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return times

    def cuda(fn):
        fn()
        torch.cuda.synchronize()
        times = []
        while len(times) < max(min_calls, 20) or sum(times) < min_seconds:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(begin.elapsed_time(end) / 1e3)
        return times

    return cuda if device.type == "cuda" else cpu


def operations(pool, ids, dtype, auto):
    """name -> (callable, backend label) for one payload; ``auto`` is the automatic
    backend (None) or the forced one on CPU."""
    import torch

    from splitserve.kernels import kv_fp8, kv_pack
    from splitserve.kernels.kv_pack_fp8 import pack_compress

    payload = torch.index_select(pool, 0, ids)
    buf, scratch = torch.empty_like(payload), pool.clone()
    packed = kv_fp8.compress(payload, backend=auto)
    fused = pack_compress(pool, ids, backend=auto)
    chosen = kv_pack.pack_backend(pool, ids.numel(), auto)
    kernel = "triton" if pool.device.type == "cuda" or auto == "triton" else "torch"
    return {
        "copy": (lambda: buf.copy_(payload), "torch"),
        "index_select": (lambda: torch.index_select(pool, 0, ids, out=buf), "torch"),
        "index_copy": (lambda: scratch.index_copy_(0, ids, payload), "torch"),
        "pack": (lambda: kv_pack.kv_pack(pool, ids, out=buf, backend=auto), chosen),
        "pack_triton": (lambda: kv_pack.kv_pack(pool, ids, out=buf, backend=kernel), kernel),
        "unpack": (lambda: kv_pack.kv_unpack(payload, scratch, ids, backend=auto), chosen),
        "unpack_triton": (lambda: kv_pack.kv_unpack(payload, scratch, ids, backend=kernel),
                          kernel),
        "pack_fp8": (lambda: pack_compress(pool, ids, out=fused, backend=auto), kernel),
        "pack_then_fp8": (lambda: kv_fp8.compress(kv_pack.kv_pack(pool, ids, backend=auto),
                                                  out=packed, backend=auto), kernel),
        "fp8_compress": (lambda: kv_fp8.compress(payload, out=packed, backend=auto), kernel),
        "fp8_decompress": (lambda: kv_fp8.decompress(*packed, dtype, out=buf, backend=auto),
                           kernel),
    }


def bench_size(target: int, device, dtype, auto, time_of) -> list[dict]:
    """Times every operation on one payload size; returns one row per operation."""
    import torch

    n, layers = geometry(target, torch.tensor([], dtype=dtype).element_size())
    gen = torch.Generator().manual_seed(target)
    pool = torch.randn(2 * n + 3, layers, 2, BLOCK_SIZE, HEADS, HEAD_DIM, generator=gen)
    pool = pool.to(device=device, dtype=dtype)
    ids = torch.randperm(pool.shape[0], generator=gen)[:n].to(device)
    nbytes = n * pool[0].numel() * pool.element_size()
    times = {name: (time_of(fn), backend)
             for name, (fn, backend) in operations(pool, ids, dtype, auto).items()}
    best = {name: min(t) for name, (t, _) in times.items()}
    return [{"target_bytes": target, "bytes": nbytes, "blocks": n, "layers_per_block": layers,
             "op": name, "backend": backend, "calls": len(t),
             "best_s": best[name], "median_s": statistics.median(t),
             "GBps": nbytes / best[name] / 1e9,
             "GBps_median": nbytes / statistics.median(t) / 1e9,
             "vs_copy": best["copy"] / best[name],
             "vs_index_select": best["index_select"] / best[name]}
            for name, (t, backend) in times.items()]


def machine(device) -> dict:
    """What the figures were measured on."""
    import torch
    import triton

    info = {"platform": platform.platform(), "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "triton": triton.__version__, "python": platform.python_version(),
            "load_average_1m": os.getloadavg()[0]}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info |= {"gpu": props.name, "multiprocessors": props.multi_processor_count,
                 "gpu_memory_bytes": props.total_memory}
    else:
        cpuinfo = Path("/proc/cpuinfo")
        names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
                 if line.startswith("model name")] if cpuinfo.exists() else []
        info["cpu_model"] = names[0] if names else platform.processor()
    return info


def results_name(device_name: str) -> str:
    """``kernels_<device>.json`` with the device's name made file-safe, e.g.
    ``NVIDIA H100 80GB HBM3`` -> ``kernels_nvidia-h100-80gb-hbm3.json``."""
    return "kernels_" + re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-") + ".json"


def parse_size(text: str) -> int:
    """``64K``, ``16M``, ``1G`` or a plain byte count."""
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:].upper(), 1)
    return int(float(text.rstrip("KkMmGg")) * scale)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--interpret", action="store_true",
                        help="CPU only: run the Triton kernels under Triton's interpreter "
                             "(slow; tiny sizes by default), a smoke test of the kernels' paths")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                        help="payload dtype (default: float32 on cpu, bfloat16 on cuda)")
    parser.add_argument("--sizes", default=None,
                        help="comma-separated payload sizes, e.g. 1M,16M (default per device)")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON output (default: benchmarks/results/kernels_<device>.json)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (default 1; 0 keeps torch's default)")
    args = parser.parse_args(argv)
    if args.interpret and args.device != "cpu":
        parser.error("--interpret runs on the CPU only")
    if args.interpret:
        # Triton decides interpreted-or-compiled when first imported, so before any import.
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    if args.threads:
        # On a small shared machine torch's multi-threaded copies stall whenever another
        # process holds a core (milliseconds per call); one thread measures the copy itself.
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a GPU")
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    mode = "interpret" if args.interpret else device.type
    auto = None if device.type == "cuda" else ("triton" if args.interpret else "torch")
    sizes = [parse_size(s) for s in args.sizes.split(",")] if args.sizes else SIZES[mode]
    time_of = timer(device, 2 if args.interpret else 5, 0.0 if args.interpret else 0.3)
    name = (results_name(torch.cuda.get_device_name(device)) if device.type == "cuda"
            else "kernels_cpu_interpret.json" if args.interpret else "kernels_cpu.json")
    out = args.out or RESULTS / name

    rows = []
    print(f"{'payload':>10} {'op':>15} {'backend':>7} {'GB/s':>8} {'median':>8} "
          f"{'vs copy':>8} {'vs i_sel':>8}")
    for target in sizes:
        for row in bench_size(target, device, dtype, auto, time_of):
            rows.append(row)
            print(f"{row['bytes'] / MIB:9.2f}M {row['op']:>15} {row['backend']:>7} "
                  f"{row['GBps']:8.3g} {row['GBps_median']:8.3g} {row['vs_copy']:8.3g} "
                  f"{row['vs_index_select']:8.3g}")
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {"command": "python " + " ".join(["benchmarks/bench_kernels.py", *sys.argv[1:]]),
              "dtype": str(dtype).removeprefix("torch."), "mode": mode, "machine": machine(device),
              "measure": "payload bytes (uncompressed, in dtype) per second of the fastest "
                         "call (GBps) and of the median call (GBps_median); vs_copy and "
                         "vs_index_select are time ratios against those rows",
              "rows": rows}
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
