"""KV transfer throughput between two processes over NIXL, against an in-process copy.

The receiver is a separate process (``splitserve.components.engines.torch_cpu.kv_transfer.peer``) holding a
registered pool; this process writes ``n`` blocks of its own pool into it with
``KvTransferAgent.write_blocks`` (direct path, arrival notification attached) and times
each call from start to completion.  Two block orders per size:

* ``merged``: consecutive ids on both sides, merged into one descriptor;
* ``scattered``: shuffled ids, no runs, one descriptor per 64 KiB block.

The baseline is ``dst.copy_(src)`` of the same bytes in this process (torch, fresh
tensors).  Every number is the median of ``--reps`` calls after one warm-up call.  UCX
transports come from ``UCX_TLS`` (``--ucx-tls``), set for both processes.

    python benchmarks/bench_kv_transfer.py [--ucx-tls sm,self] [--reps 15]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

SIZES = [64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
BLOCK_SHAPE = (1, 2, 16, 8, 64)          # one layer, K/V, 16 tokens, 8 heads, dim 64: 64 KiB
BLOCK_BYTES = 2 * 16 * 8 * 64 * 4
NUM_BLOCKS = max(SIZES) // BLOCK_BYTES * 2     # room for the scattered layout


def memcpy_gbps(nbytes: int, reps: int) -> float:
    """One thread, like the transfer: torch's two-thread copy is slower here below 64 MiB
    (thread wake-up), so one thread is the stronger baseline on this machine."""
    torch.set_num_threads(1)
    src = torch.randn(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times) / 1e9


async def transfer_rows(etcd: str, reps: int, progress_thread: bool) -> list[dict]:
    from splitserve.components.engines.torch_cpu.kv_transfer import KvTransferAgent, KvTransferConfig

    pool = torch.randn(NUM_BLOCKS, *BLOCK_SHAPE)
    cfg = KvTransferConfig(namespace="bench", staging_bytes=0, timeout_s=60,
                           progress_thread=progress_thread)
    rows = []
    async with KvTransferAgent("bench-prefill", pool, etcd_endpoints=etcd, config=cfg) as agent:
        rng = random.Random(0)
        for nbytes in SIZES:
            n = nbytes // BLOCK_BYTES
            orders = {"merged": (list(range(n)), list(range(n, 2 * n)))}
            ids = rng.sample(range(NUM_BLOCKS), 2 * n)
            orders["scattered"] = (ids[:n], ids[n:])
            for mode, (src, dst) in orders.items():
                times, descs = [], 0
                for i in range(reps + 1):
                    t0 = time.perf_counter()
                    res = await agent.write_blocks("bench-decode", src, dst, b"",
                                                   request_id=f"{mode}-{nbytes}-{i}")
                    if i:       # the first call is a warm-up (connection, page faults)
                        times.append(time.perf_counter() - t0)
                    descs = res.descriptors
                med = statistics.median(times)
                rows.append({"bytes": nbytes, "mode": mode, "descriptors": descs,
                             "median_s": med, "gbps": nbytes / med / 1e9})
    return rows


def run(args: argparse.Namespace) -> dict:
    from splitserve.infra.embedded import EmbeddedInfra

    if args.ucx_tls:
        os.environ["UCX_TLS"] = args.ucx_tls
    os.environ.setdefault("UCX_NET_DEVICES", "lo")      # TCP, if chosen, stays on loopback
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    with tempfile.TemporaryDirectory() as tmp, EmbeddedInfra(Path(tmp)) as ep:
        shape = ",".join(str(x) for x in (NUM_BLOCKS, *BLOCK_SHAPE))
        peer = subprocess.Popen(
            [sys.executable, "-m", "splitserve.components.engines.torch_cpu.kv_transfer.peer",
             "--name", "bench-decode", "--etcd", ep.etcd, "--namespace", "bench",
             "--shape", shape, "--staging-bytes", "0"]
            + (["--progress-thread"] if args.receiver_progress_thread else []),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            ready = peer.stdout.readline()
            if "ready" not in ready:
                raise RuntimeError(f"peer did not start: {ready!r}")
            rows = asyncio.run(transfer_rows(ep.etcd, args.reps, args.sender_progress_thread))
        finally:
            peer.stdin.close()
            try:
                peer.wait(10)
            except subprocess.TimeoutExpired:
                peer.kill()
                peer.wait()
    for row in rows:
        row["memcpy_gbps"] = memcpy_gbps(row["bytes"], args.reps)
        row["vs_memcpy"] = row["gbps"] / row["memcpy_gbps"]
    return {"ucx_tls": os.environ.get("UCX_TLS", "(UCX default)"), "reps": args.reps,
            "receiver_progress_thread": args.receiver_progress_thread,
            "sender_progress_thread": args.sender_progress_thread,
            "block_bytes": BLOCK_BYTES, "cpus": os.cpu_count(),
            "machine": platform.machine(), "torch_threads": torch.get_num_threads(),
            "rows": rows}


def table(result: dict) -> str:
    on = {True: "on", False: "off"}
    lines = [(f"UCX_TLS={result['ucx_tls']}; NIXL progress thread: sender "
             f"{on[result['sender_progress_thread']]}, receiver "
             f"{on[result['receiver_progress_thread']]}"),
             "| payload | order | descs | NIXL GB/s | memcpy GB/s | ratio |",
             "|---:|---|---:|---:|---:|---:|"]
    for r in result["rows"]:
        size = f"{r['bytes'] >> 20} MiB" if r["bytes"] >= 1 << 20 else f"{r['bytes'] >> 10} KiB"
        lines.append(f"| {size} | {r['mode']} | {r['descriptors']} | {r['gbps']:.2f} | "
                     f"{r['memcpy_gbps']:.2f} | {r['vs_memcpy']:.0%} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ucx-tls", default=None, help="UCX_TLS for both processes")
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--sender-progress-thread", action=argparse.BooleanOptionalAction,
                   default=False, help="NIXL progress thread in the sending process")
    p.add_argument("--receiver-progress-thread", action=argparse.BooleanOptionalAction,
                   default=False, help="NIXL progress thread in the receiving process")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/kv_transfer.json"))
    p.add_argument("--append", action="store_true",
                   help="add this run to the runs already in --out")
    args = p.parse_args()
    result = run(args)
    print(table(result))
    runs = []
    if args.append and args.out.exists():
        runs = json.loads(args.out.read_text())["runs"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"runs": runs + [result]}, indent=2) + "\n")


if __name__ == "__main__":
    main()
