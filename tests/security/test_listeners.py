"""Every listening TCP socket of a running disaggregated graph is on loopback.

The graph (frontend, router, decode and prefill workers, embedded etcd and NATS, the
supervisor) is started for real; the listening sockets of every process in its tree are
read from /proc (socket inodes of each process's fds, matched in /proc/<pid>/net/tcp{,6}).
"""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path

import pytest

from tests.integration.serve_helpers import ServeRun

pytestmark = [pytest.mark.security, pytest.mark.integration, pytest.mark.slow,
              pytest.mark.skipif(not Path("/proc/self/net/tcp").exists(), reason="needs /proc")]

LISTEN = "0A"


def descendants(root: int) -> set[int]:
    """``root`` and every process below it (by parent pid)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid not in out:
            out.add(pid)
            todo.extend(children.get(pid, []))
    return out


def socket_inodes(pid: int) -> set[str]:
    inodes = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return inodes
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return inodes


def decode_address(hex_addr: str) -> str:
    """/proc/net/tcp's little-endian hex address (IPv4 or IPv6) as text."""
    raw = bytes.fromhex(hex_addr)
    if len(raw) == 4:
        return str(ipaddress.IPv4Address(raw[::-1]))
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
    v6 = ipaddress.IPv6Address(words)
    return str(v6.ipv4_mapped or v6)


def listeners(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every listening TCP socket that ``pid`` holds."""
    mine = socket_inodes(pid)
    found = []
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            local, state, inode = cols[1], cols[3], cols[9]
            if state == LISTEN and inode in mine:
                addr, port = local.rsplit(":", 1)
                found.append((decode_address(addr), int(port, 16)))
    return found


def test_decoding_of_proc_net_addresses():
    assert decode_address("0100007F") == "127.0.0.1"
    assert decode_address("00000000") == "0.0.0.0"
    assert decode_address("00000000000000000000000001000000") == "::1"


@pytest.mark.timeout(600)  # model loading on a busy 2-core machine
@pytest.mark.parametrize("config", [
    pytest.param("configs/disagg.yaml", id="torch", marks=pytest.mark.deep),
    pytest.param("configs/mocker_disagg.yaml", id="mocker")])
def test_every_listener_of_the_disagg_graph_is_on_loopback(tmp_path, config):
    run = ServeRun(tmp_path, "graphs.disagg:Frontend", "-f", config, "--Frontend.port=0")
    try:
        ready = run.wait_ready(540)
        replica_pids = {r["pid"] for r in ready["rows"]}
        components = {r["component"] for r in ready["rows"]}
        assert {"Frontend", "Router", "DecodeWorker", "PrefillWorker"} <= components
        tree = descendants(run.proc.pid)
        assert replica_pids <= tree and set(run.infra_pids()) <= tree
        by_pid = {pid: listeners(pid) for pid in tree}
        # The check must see real sockets: every replica listens (request plane, response
        # streams, metrics), so an empty table would mean the probe is broken.
        for pid in replica_pids:
            assert by_pid[pid], f"no listening socket found for replica pid {pid}"
        exposed = {(pid, addr, port) for pid, socks in by_pid.items() for addr, port in socks
                   if addr not in ("127.0.0.1", "::1")}
        assert not exposed, f"listeners beyond loopback: {sorted(exposed)}"
    finally:
        run.stop()


def test_a_kv_transfer_agent_started_outside_serve_stays_on_loopback():
    """UCX's TCP transport listens on the external address unless told otherwise; the KV
    agent defaults to loopback even without the supervisor's environment."""
    import json
    import subprocess
    import sys

    code = (
        "import json, os, sys, torch\n"
        "sys.path.insert(0, os.getcwd())\n"
        "from splitserve.components.engines.torch_cpu.kv_transfer.nixl_port import NixlPort\n"
        "from tests.security.test_listeners import listeners\n"
        "port = NixlPort('probe', 'UCX')\n"
        "port.register(torch.zeros(4096))\n"
        "port.metadata()\n"
        "print(json.dumps(listeners(os.getpid())))\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=120, check=False,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr[-2000:]
    socks = json.loads(out.stdout.strip().splitlines()[-1])
    assert socks, "UCX opened no listener: the probe would prove nothing"
    assert all(addr in ("127.0.0.1", "::1") for addr, _ in socks), socks
