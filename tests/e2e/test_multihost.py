"""One disaggregated torch graph spread over three hosts (Linux network namespaces).

Host a runs etcd, NATS (their binaries, on a's address) and ``dynamo serve --only
Frontend,Router``; host b ``--only DecodeWorker``; host c ``--only PrefillWorker``; each
with ``Common.bind_host`` set to its own address.  Requests enter on a; the prefill
worker on c writes the prompt's KV into b's cache over NIXL/UCX (TCP between the
namespaces: ``UCX_TLS=tcp`` in the workers' ``env``, as shared memory would otherwise
be reachable between namespaces of one machine).  Checked: greedy answers equal the
single-host aggregated graph's, remote prefill was counted on both sides, and every
listening socket of every host's processes is on that host's address (``ss -ltnp``),
loopback only for each supervisor's control endpoint.  The deep tests kill the prefill
host (decode prefills locally), unplug the decode host's link (requests fail fast
with a retryable error, the worker's registration expires, and it serves again once the
link is back), and, with a second decode worker on host d, unplug the host serving
answers mid-stream (they resume on the other host and equal undisturbed answers).  Every
namespace and process is removed by the fixtures, by pid.
"""

from __future__ import annotations

import base64
import concurrent.futures as cf
import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import openai
import pytest

from splitserve.bench.graphrun import ServeProcess, dynamo_cmd
from splitserve.contracts.kit.procs import find_binary
from tests.e2e import netns
from tests.e2e.helpers import scrape
from tests.e2e.prompts import FORCED, MODEL, QUESTIONS, SHARED
from tests.integration.serve_helpers import PRELOAD_OFF, REPO, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.slow,
              pytest.mark.skipif(bool(netns.available()), reason=str(netns.available()))]

GRAPH, CONFIG = "graphs.disagg:Frontend", "configs/disagg.yaml"
# Every host is given the same config and overrides: one graph, split by --only.
# A remote prefill's timeout short enough for the killed-prefill-host test to fall back
# well within its bound, long enough for a first prefill over a fresh connection on a
# loaded 2-core machine (4 s fell back once there, under the test command's 3 workers).
OVERRIDES = (FORCED, "--DecodeWorker.remote_prefill_timeout_s=10",
             "--DecodeWorker.env={UCX_TLS: tcp}", "--PrefillWorker.env={UCX_TLS: tcp}",
             "--Common.restart.backoff_initial_s=0.2",
             # one decode replica per host: a fixed metrics port stays right in the ready
             # file's rows after the supervisor restarts the replica (the link-down test)
             "--DecodeWorker.metrics_port=9400",
             # no tools are sent: host a's frontend need not import the tool-call parsers
             # before ready (as every ServeRun of the tests, serve_helpers._test_args)
             PRELOAD_OFF)
PARTS = {"a": "Frontend,Router", "b": "DecodeWorker", "c": "PrefillWorker", "d": "DecodeWorker"}
PROMPTS = [QUESTIONS[0], QUESTIONS[4], SHARED + QUESTIONS[2]]


class HostServe(ServeProcess):
    """``dynamo serve --only ...`` inside one host's namespace (same pid: ``ip netns
    exec`` execs it); state, ready file and log under ``tmp`` as ``ServeProcess``."""

    def __init__(self, hosts: netns.Hosts, host: str, tmp: Path, *args: str) -> None:
        self.tmp, self.host = tmp, host
        tmp.mkdir(parents=True, exist_ok=True)
        self.state = tmp / "state"
        self.ready_file = tmp / "ready.json"
        self.log_path = tmp / "serve.log"
        self.log = open(self.log_path, "wb")  # noqa: SIM115 - closed in kill_all()
        self.proc = subprocess.Popen(
            hosts.argv(host, [*dynamo_cmd(), "serve", GRAPH, "-f", CONFIG, "--no-status",
                              "--state-dir", str(self.state), "--ready-file",
                              str(self.ready_file), *args]),
            cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True)
        self.seen_pids: set[int] = set()

    def rows(self) -> list[dict]:
        return json.loads(self.ready_file.read_text())["rows"]


def _wait_http(url: str, timeout_s: float, what: str) -> None:
    def ok() -> bool:
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(url, timeout=1).status_code == 200
        return False
    wait_until(ok, timeout_s, 0.1, what)


@pytest.fixture(scope="module")
def hosts():
    h = netns.Hosts(("a", "b", "c", "d"))  # d: a second decode host, started by one test
    try:
        yield h.up()
    finally:
        h.close()


@pytest.fixture(scope="module")
def infra(hosts, tmp_path_factory):
    """etcd and NATS (JetStream) on host a's address; yields (etcd URL, NATS URL)."""
    tmp, a = tmp_path_factory.mktemp("infra"), hosts.addr("a")
    client, peer = f"http://{a}:2379", f"http://{a}:2380"
    argvs = {
        "etcd": [find_binary("etcd"), "--name", "a", "--data-dir", str(tmp / "etcd"),
                 "--listen-client-urls", client, "--advertise-client-urls", client,
                 "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                 "--initial-cluster", f"a={peer}", "--log-level", "warn"],
        "nats": [find_binary("nats-server"), "-a", a, "-p", "4222", "-js", "-sd",
                 str(tmp / "nats"), "-m", "8222"]}
    procs = []
    try:
        for name, argv in argvs.items():
            with open(tmp / f"{name}.log", "wb") as log:
                procs.append(subprocess.Popen(hosts.argv("a", argv), stdout=log,
                                              stderr=subprocess.STDOUT, start_new_session=True))
        _wait_http(f"{client}/health", 20, "etcd on host a")
        _wait_http(f"http://{a}:8222/healthz", 20, "NATS on host a")
        yield client, f"nats://{a}:4222", [p.pid for p in procs]
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                p.kill()
            p.wait(10)


def start_part(hosts, infra, tmp: Path, host: str, *extra: str) -> HostServe:
    addr = hosts.addr(host)
    args = ["--only", PARTS[host], "--etcd", infra[0], "--nats", infra[1],
            f"--Common.bind_host={addr}", *OVERRIDES, *extra]
    if host == "a":
        args += [f"--Frontend.host={addr}", "--Frontend.port=0"]
    return HostServe(hosts, host, tmp / host, *args)


@pytest.fixture(scope="module")
def graph(hosts, infra, tmp_path_factory):
    """The graph over the three hosts: {host: HostServe}; the frontend's URL."""
    tmp = tmp_path_factory.mktemp("multihost")
    parts: dict[str, HostServe] = {}
    try:
        for host in ("b", "c", "a"):  # workers first: the frontend is ready with them
            parts[host] = start_part(hosts, infra, tmp, host)
        for part in parts.values():
            part.wait_ready(240)
        url = next(r["endpoint"] for r in parts["a"].rows() if r["component"] == "Frontend")
        _wait_http(f"{url}/ready", 60, "the frontend ready")
        yield parts, url
    finally:
        for part in parts.values():
            with contextlib.suppress(Exception):
                part.stop(timeout_s=30)
            part.kill_all()


def ask(url: str, prompt: str, max_tokens: int = 16, timeout: float = 120) -> str:
    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0,
                       timeout=timeout) as c:
        r = c.chat.completions.create(model=MODEL, temperature=0, max_tokens=max_tokens,
                                      messages=[{"role": "user", "content": prompt}])
    return r.choices[0].message.content


def counted(part: HostServe, component: str, name: str) -> dict:
    """The samples ``name`` of ``component``'s replicas on that host, by labels."""
    out: dict = {}
    for row in part.rows():
        if row["component"] == component and row["metrics"]:
            for key, value in scrape(row["metrics"]).get(name, {}).items():
                out[key] = out.get(key, 0.0) + value
    return out


def test_requests_on_host_a_are_prefilled_on_c_and_decoded_on_b(graph, agg_torch):
    parts, url = graph
    expected = [ask(agg_torch[1], p) for p in PROMPTS]
    assert [ask(url, p) for p in PROMPTS] == expected
    decisions = counted(parts["b"], "DecodeWorker", "splitserve_disagg_decisions_total")
    assert decisions == {(("reason", "forced-remote"), ("where", "remote")): len(PROMPTS)}
    assert counted(parts["b"], "DecodeWorker", "splitserve_disagg_fallbacks_total") == {}
    jobs = counted(parts["c"], "PrefillWorker", "splitserve_prefill_jobs_total")
    assert jobs == {(("outcome", "done"),): len(PROMPTS)}


def test_every_listener_is_on_its_hosts_address(graph, hosts, infra):
    parts, _ = graph
    for host, part in parts.items():
        part.note_descendants()
        mine = part.seen_pids | {part.proc.pid}
        if host == "a":
            mine |= set(infra[2])
        socks = [s for s in hosts.listeners(host) if set(s[2]) & mine]
        replicas = {r["pid"] for r in part.rows()}
        # every replica listens (request plane, response streams, metrics): an empty
        # table would mean the probe is broken
        assert replicas <= {p for s in socks for p in s[2]}, (host, socks)
        control = urlsplit_port(json.loads(next(part.state.glob("supervisors/*.json"))
                                           .read_text())["control"])
        wrong = [s for s in socks if s[0] != hosts.addr(host)
                 and not (s[0] == "127.0.0.1" and s[1] == control
                          and s[2] == [part.proc.pid])]
        assert not wrong, f"host {host}: listeners off {hosts.addr(host)}: {wrong}"


def urlsplit_port(url: str) -> int:
    return int(url.rsplit(":", 1)[1].split("/", 1)[0])


def decode_instances(etcd: str) -> list[str]:
    """The decode worker's endpoint registrations in etcd (Dynamo's
    ``v1/instances/<namespace>/decodeworker/...``, held by its runtime's lease), read
    through etcd's JSON gateway."""
    prefix = b"v1/instances/dynamo/decodeworker/"
    end = prefix[:-1] + bytes([prefix[-1] + 1])
    body = {"key": base64.b64encode(prefix).decode(),
            "range_end": base64.b64encode(end).decode(), "keys_only": True}
    r = httpx.post(f"{etcd}/v3/kv/range", json=body, timeout=5).json()
    return [base64.b64decode(kv["key"]).decode() for kv in r.get("kvs", [])]


@pytest.mark.deep
def test_the_prefill_host_killed_means_local_prefill(graph, hosts, infra, tmp_path, agg_torch):
    parts, url = graph
    before = counted(parts["b"], "DecodeWorker", "splitserve_disagg_decisions_total")
    parts["c"].note_descendants()
    for pid in [*parts["c"].seen_pids, parts["c"].proc.pid]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    assert ask(url, PROMPTS[0], timeout=60) == ask(agg_torch[1], PROMPTS[0])
    assert time.monotonic() - t0 < 30
    after = counted(parts["b"], "DecodeWorker", "splitserve_disagg_decisions_total")
    local = sum(v for k, v in after.items() if ("where", "local") in k) - \
        sum(v for k, v in before.items() if ("where", "local") in k)
    fell_back = counted(parts["b"], "DecodeWorker", "splitserve_disagg_fallbacks_total")
    assert local == 1 or fell_back, (before, after, fell_back)
    # the prefill host comes back and remote prefill works again
    parts["c"].kill_all()
    parts["c"] = start_part(hosts, infra, tmp_path, "c")
    parts["c"].wait_ready(240)
    wait_until(lambda: counted(parts["c"], "PrefillWorker", "splitserve_prefill_jobs_total")
               or ask(url, PROMPTS[1]) is None, 60, 1.0, "a remote prefill on the new host c")


@pytest.mark.deep
def test_the_decode_host_unplugged_fails_fast_then_serves_again(graph, hosts, infra):
    parts, url = graph
    assert "Paris" in ask(url, QUESTIONS[0])
    assert decode_instances(infra[0])
    hosts.link("b", False)
    t0 = time.monotonic()
    try:
        with cf.ThreadPoolExecutor(1) as pool:
            fut = pool.submit(httpx.post, f"{url}/v1/chat/completions", timeout=120, json={
                "model": MODEL, "max_tokens": 8, "temperature": 0,
                "messages": [{"role": "user", "content": QUESTIONS[1]}]})
            r = fut.result(timeout=90)
        failed_after = time.monotonic() - t0
        # a retryable error with an OpenAI-style body, not a hang
        assert r.status_code == 503 and r.json()["error"]["code"], r.text
        assert failed_after < 30, failed_after
        wait_until(lambda: not decode_instances(infra[0]), 60, 0.5,
                   "the decode worker's registration expired")
        deregistered_after = time.monotonic() - t0
    finally:
        hosts.link("b", True)
    t1 = time.monotonic()
    wait_until(lambda: _answers(url), 120, 1.0, "the decode host serving again")
    # the figures docs/deploy.md quotes (pytest -s shows them), and what host b's
    # supervisor did once the link was back
    events = [line for line in parts["b"].output().splitlines()
              if "lease" in line or "restarting" in line or "dependency" in line]
    print(f"\nunplugged: request failed after {failed_after:.1f}s, registration gone "
          f"after {deregistered_after:.1f}s; plugged back: serving after "
          f"{time.monotonic() - t1:.1f}s\n" + "\n".join(events[-8:]))


def _answers(url: str) -> bool:
    with contextlib.suppress(Exception):
        return "Paris" in ask(url, QUESTIONS[0], timeout=20)
    return False


STORY = "Write a long story about a lighthouse keeper who finds a map in a bottle."


def stream_text(url: str, prompt: str, max_tokens: int, first: cf.Future | None = None) -> str:
    """A streamed greedy chat answer; sets ``first`` once its first text arrives."""
    text = []
    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0,
                       timeout=120) as c:
        for chunk in c.chat.completions.create(
                model=MODEL, temperature=0, max_tokens=max_tokens, stream=True,
                messages=[{"role": "user", "content": prompt}]):
            if chunk.choices and chunk.choices[0].delta.content:
                text.append(chunk.choices[0].delta.content)
                if first is not None and not first.done():
                    first.set_result(time.monotonic())
    return "".join(text)


@pytest.mark.deep
def test_a_decode_host_unplugged_mid_answer_resumes_on_the_other(graph, hosts, infra, tmp_path,
                                                                 agg_torch):
    """Host d brings a second decode worker; the host serving answers is unplugged once
    they stream: no reset reaches the frontend, so its stall limit (10 s, the default) takes
    the silence for a lost worker and resumes each answer on the other host after the tokens
    the client has; every answer equals an undisturbed one."""
    parts, url = graph
    prompts = [f"{STORY} Chapter {i}." for i in range(3)]
    expected = [stream_text(agg_torch[1], p, 48) for p in prompts]
    before = len(decode_instances(infra[0]))
    parts["d"] = start_part(hosts, infra, tmp_path, "d")
    unplugged = None
    try:
        parts["d"].wait_ready(240)
        wait_until(lambda: len(decode_instances(infra[0])) >= 2 * before, 60, 0.5,
                   "host d's decode worker registered")
        wait_until(lambda: _answers(url), 60, 1.0, "the graph answering with two decode hosts")
        with cf.ThreadPoolExecutor(len(prompts)) as pool:
            firsts = [cf.Future() for _ in prompts]
            futs = [pool.submit(stream_text, url, p, 48, f) for p, f in zip(prompts, firsts, strict=True)]
            cf.wait(firsts, timeout=120, return_when=cf.ALL_COMPLETED)
            running = {h: sum(counted(parts[h], "DecodeWorker",
                                      "splitserve_worker_running_requests").values())
                       for h in ("b", "d")}
            unplugged = max(running, key=running.get)
            assert running[unplugged] >= 1, running
            survivor = "d" if unplugged == "b" else "b"
            fallbacks = counted(parts[survivor], "DecodeWorker",
                                "splitserve_disagg_fallbacks_total")
            hosts.link(unplugged, False)
            t0 = time.monotonic()
            got = [f.result(timeout=120) for f in futs]
        resumed_after = time.monotonic() - t0
        assert got == expected
        # the resumed answers were prefilled on host c again: their jobs (same request
        # ids, longer prompts) were not dropped by the queue as duplicates of the first
        assert counted(parts[survivor], "DecodeWorker",
                       "splitserve_disagg_fallbacks_total") == fallbacks
        moved = scrape(f"{url}/metrics").get("splitserve_frontend_migrations_total", {})
        assert moved.get((("reason", "worker-stalled"),), 0) >= 1, moved
        print(f"\nunplugged host {unplugged} (running {running}); every answer done "
              f"{resumed_after:.1f}s later, migrations {moved}")
    finally:
        if unplugged:
            hosts.link(unplugged, True)
        with contextlib.suppress(Exception):
            parts["d"].stop(timeout_s=30)
        parts["d"].kill_all()
        del parts["d"]
