"""A stand-alone receiving agent in its own process, driven by JSON lines on stdin.

Used by the two-process integration test and the benchmark; also handy to poke a
prefill worker by hand.  The pool is filled from ``--seed`` so the other process can
rebuild the expected bytes.  Commands (one JSON object per line), each answered by one
JSON line on stdout:

* ``{"cmd": "wait", "request_id": "r1", "timeout": 5}`` -> ``{"arrived": "r1", "peer": ..,
  "payload": "<hex>"}`` or ``{"timeout": "r1"}``
* ``{"cmd": "dump", "path": "pool.pt"}`` -> ``{"dumped": "pool.pt"}``
* ``{"cmd": "exit"}`` or end of input -> close the agent (record removed) and exit.

Usage: ``python -m splitserve.components.engines.torch_cpu.kv_transfer.peer --name D --etcd URL
--shape 32,2,2,4,3,8 [--seed 0] [--tp-size 1 --tp-rank 0 --total-heads H]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

import torch

from .agent import KvTransferAgent
from .config import KvTransferConfig
from .errors import TransferTimeout


def seeded_pool(shape: tuple[int, ...], seed: int, dtype: torch.dtype) -> torch.Tensor:
    """The pool a peer with ``seed`` starts with (random normal; never zeros)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype)


def _say(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


async def _serve(args: argparse.Namespace) -> None:
    shape = tuple(int(x) for x in args.shape.split(","))
    pool = seeded_pool(shape, args.seed, getattr(torch, args.dtype))
    config = KvTransferConfig(namespace=args.namespace, staging_bytes=args.staging_bytes,
                              progress_thread=args.progress_thread)
    agent = KvTransferAgent(args.name, pool, etcd_endpoints=args.etcd, config=config,
                            tp_size=args.tp_size, tp_rank=args.tp_rank,
                            total_kv_heads=args.total_heads)
    loop = asyncio.get_running_loop()
    try:
        await agent.start()
        agent.start_poller()
        _say({"ready": args.name})
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            cmd = json.loads(line)
            if cmd["cmd"] == "wait":
                try:
                    got = await agent.wait_for(cmd["request_id"], cmd.get("timeout", 5.0))
                    _say({"arrived": got.request_id, "peer": got.peer,
                          "payload": got.payload.hex()})
                except TransferTimeout:
                    _say({"timeout": cmd["request_id"]})
            elif cmd["cmd"] == "dump":
                torch.save(pool, cmd["path"])
                _say({"dumped": cmd["path"]})
            elif cmd["cmd"] == "exit":
                break
    finally:
        await agent.close()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--name", required=True)
    p.add_argument("--etcd", required=True, help="etcd endpoints, e.g. http://127.0.0.1:2379")
    p.add_argument("--namespace", default="default")
    p.add_argument("--shape", required=True, help="pool shape N,L,2,B,H,D")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--tp-rank", type=int, default=0)
    p.add_argument("--total-heads", type=int, default=None)
    p.add_argument("--staging-bytes", type=int, default=16 * 1024 * 1024)
    p.add_argument("--progress-thread", action="store_true",
                   help="run NIXL's progress thread (spins on a core)")
    asyncio.run(_serve(p.parse_args(argv)))


if __name__ == "__main__":
    main()
