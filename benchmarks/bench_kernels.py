"""Throughput of the KV-movement kernels against a plain copy of the same bytes.

For payloads from 64 KiB to 64 MiB this times pack (gather blocks into a payload), unpack
(scatter it back), fp8 compress and fp8 decompress, and ``dst.copy_(src)`` of the payload's
bytes, the practical memory-bandwidth ceiling.  Throughput is payload bytes (in the
payload's own dtype) per second of the fastest of repeated calls (the median is kept too:
on a shared machine the fastest call is the one least disturbed by other processes), the
same measure for every row, so ``vs_copy`` is a fraction of what a copy of the same
payload achieves.

Block geometry is the served model's: block_size 16, 3 KV heads, head_dim 64.  Payloads of
4 blocks or more use whole 30-layer blocks; smaller ones use one-layer blocks (the unit of
layer-wise streaming), so that even 64 KiB is several blocks gathered from a shuffled
block table.

    python benchmarks/bench_kernels.py                  # CPU: torch references, 1 thread
    python benchmarks/bench_kernels.py --device cuda    # GPU: compiled Triton kernels
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import triton

from splitserve.kernels import kv_fp8, kv_pack

BLOCK_SIZE, HEADS, HEAD_DIM, LAYERS = 16, 3, 64, 30
SIZES = [64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]


def geometry(target_bytes: int, elem_bytes: int) -> tuple[int, int]:
    """(blocks, layers per block) whose payload is closest to ``target_bytes``."""
    layer_bytes = 2 * BLOCK_SIZE * HEADS * HEAD_DIM * elem_bytes
    layers = LAYERS if target_bytes >= 4 * LAYERS * layer_bytes else 1
    return max(1, round(target_bytes / (layers * layer_bytes))), layers


def timer(device: torch.device) -> Callable[[Callable[[], object]], list[float]]:
    """Returns a function giving the seconds of repeated calls (>= 5 calls, >= 0.3 s)."""
    def cpu(fn):
        fn()
        times, start = [], time.perf_counter()
        while len(times) < 5 or time.perf_counter() - start < 0.3:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return times

    def cuda(fn):
        fn()
        torch.cuda.synchronize()
        times = []
        while len(times) < 20 or sum(times) < 0.2:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(begin.elapsed_time(end) / 1e3)
        return times

    return cuda if device.type == "cuda" else cpu


def bench_size(target: int, device: torch.device, dtype: torch.dtype, backend: str) -> list[dict]:
    """Times every operation on one payload size; returns one row per operation."""
    n, layers = geometry(target, torch.tensor([], dtype=dtype).element_size())
    gen = torch.Generator().manual_seed(target)
    pool = torch.randn(2 * n + 3, layers, 2, BLOCK_SIZE, HEADS, HEAD_DIM, generator=gen)
    pool = pool.to(device=device, dtype=dtype)
    ids = torch.randperm(pool.shape[0], generator=gen)[:n].to(device)
    payload = kv_pack.kv_pack(pool, ids, backend=backend)
    buf = torch.empty_like(payload)
    packed = kv_fp8.compress(payload, backend=backend)
    ops = {
        "copy": lambda: buf.copy_(payload),
        "pack": lambda: kv_pack.kv_pack(pool, ids, out=buf, backend=backend),
        "unpack": lambda: kv_pack.kv_unpack(payload, pool, ids, backend=backend),
        "fp8_compress": lambda: kv_fp8.compress(payload, out=packed, backend=backend),
        "fp8_decompress": lambda: kv_fp8.decompress(*packed, dtype, out=buf, backend=backend),
    }
    time_of = timer(device)
    nbytes = payload.numel() * payload.element_size()
    times = {name: time_of(fn) for name, fn in ops.items()}
    best = {name: min(t) for name, t in times.items()}
    return [{"target_bytes": target, "bytes": nbytes, "blocks": n, "layers_per_block": layers,
             "op": name, "backend": "torch" if name == "copy" else backend, "calls": len(t),
             "best_s": best[name], "median_s": statistics.median(t),
             "GBps": nbytes / best[name] / 1e9,
             "GBps_median": nbytes / statistics.median(t) / 1e9,
             "vs_copy": best["copy"] / best[name]}
            for name, t in times.items()]


def machine(device: torch.device) -> dict:
    """What the figures were measured on."""
    info = {"platform": platform.platform(), "processor": platform.processor(),
            "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "triton": triton.__version__, "python": platform.python_version(),
            "load_average_1m": os.getloadavg()[0]}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    else:
        cpuinfo = Path("/proc/cpuinfo")
        names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
                 if line.startswith("model name")] if cpuinfo.exists() else []
        info["cpu_model"] = names[0] if names else platform.processor()
    return info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                        help="payload dtype (default: float32 on cpu, bfloat16 on cuda)")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON output (default: benchmarks/results/kernels_<device>.json)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (default 1; 0 keeps torch's default)")
    args = parser.parse_args(argv)
    if args.threads:
        # On a small shared machine torch's multi-threaded copies stall whenever another
        # process holds a core (milliseconds per call); one thread measures the copy itself.
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    backend = "triton" if device.type == "cuda" else "torch"
    out = args.out or Path(__file__).parent / "results" / f"kernels_{device.type}.json"

    rows = []
    print(f"{'payload':>10} {'op':>15} {'backend':>7} {'GB/s':>8} {'median':>8} {'vs copy':>8}")
    for target in SIZES:
        for row in bench_size(target, device, dtype, backend):
            rows.append(row)
            print(f"{row['bytes'] / 2**20:9.2f}M {row['op']:>15} {row['backend']:>7} "
                  f"{row['GBps']:8.2f} {row['GBps_median']:8.2f} {row['vs_copy']:8.2f}")
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {"command": "python " + " ".join(["benchmarks/bench_kernels.py", *sys.argv[1:]]),
              "dtype": str(dtype).removeprefix("torch."), "machine": machine(device),
              "measure": "payload bytes per second of the fastest call (GBps) and of the "
                         "median call (GBps_median)", "rows": rows}
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
