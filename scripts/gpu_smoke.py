"""One-command GPU smoke test of an engine's graphs: what to run first on a GPU machine.

    python scripts/gpu_smoke.py sglang|trtllm|vllm --model /models/Llama-3.1-8B-Instruct

It brings up the engine's aggregated graph, asks a few prompts greedily, stops it, then
brings up the disaggregated graph with remote prefill forced and checks:

- equality: every answer equals the aggregated graph's, token for token (greedy);
- cancellation: a client leaving mid-stream frees the decode engine's request;
- killed prefill worker: with the prefill worker SIGKILLed (its engine processes too),
  a request still gets an answer (SGLang: after the replica restarts, since its decode
  engines cannot prefill) and the restarted replica serves remote prefills again;

and prints a table.  Exit status 0 when every check passed.  With one GPU, prefill and
decode share it (Common.allow_shared_devices) at a smaller memory share each; with two
or more, the configs' own placement (decode on GPU 0, prefill on GPU 1) is used.
``tests/gpu/test_gpu_smoke.py`` runs it where a GPU, the engine and a model exist.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.integration.serve_helpers import ServeRun  # noqa: E402

FORCED_REMOTE = "{enable: true, decider: forced, remote: true}"
FORCED_LOCAL = "{enable: true, decider: forced, remote: false}"
PROMPTS = [
    "What is the capital of France?", "Name three primary colours.",
    "Write the numbers from one to ten in words.", "Who wrote Hamlet?",
    "Explain in one sentence what a GPU is.",
]
RUNNING = "splitserve_worker_running_requests"


@dataclass(frozen=True)
class EngineGraphs:
    """An engine's aggregated reference and disaggregated graph, and its config keys."""

    agg: tuple[str, str, tuple[str, ...]]
    disagg: tuple[str, str]
    memory_key: str           # engine_args field of the GPU memory share
    agg_sections: tuple[str, ...]


ENGINES = {
    "sglang": EngineGraphs(("graphs.agg_router:Frontend", "configs/sglang_agg.yaml", ()),
                           ("graphs.disagg:Frontend", "configs/sglang_disagg.yaml"),
                           "mem_fraction_static", ("Worker",)),
    "trtllm": EngineGraphs(("graphs.agg_router:Frontend", "configs/trtllm_agg.yaml", ()),
                           ("graphs.disagg:Frontend", "configs/trtllm_disagg.yaml"),
                           "free_gpu_memory_fraction", ("Worker",)),
    # vLLM's reference is the same decode engine prefilling locally (forced local).
    "vllm": EngineGraphs(("graphs.disagg:Frontend", "configs/vllm_disagg_gpu.yaml",
                          (f"--DecodeWorker.disaggregated_router={FORCED_LOCAL}",)),
                         ("graphs.disagg:Frontend", "configs/vllm_disagg_gpu.yaml"),
                         "extra_engine_args.gpu_memory_utilization",
                         ("DecodeWorker", "PrefillWorker")),
}


def gpu_count() -> int:
    """GPUs nvidia-smi lists (0 without a driver)."""
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True,
                             timeout=30, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def overrides(eng: EngineGraphs, sections: tuple[str, ...], model: str, gpus: int,
              disagg: bool, served: str = "meta-llama/Llama-3.1-8B-Instruct") -> list[str]:
    """Command-line overrides: the model (every engine loads Common.model), the name
    clients send, and sharing one GPU when there is one."""
    out = [f"--Common.model={model}", f"--Common.served_model_name={served}",
           f"--Frontend.model_dir={model}", "--Frontend.port=0"]
    if disagg and gpus < 2:
        out += ["--Common.allow_shared_devices=true", "--PrefillWorker.devices=[0]"]
        out += [f"--{s}.engine_args.{eng.memory_key}=0.4" for s in sections]
    return out


def ask(url: str, prompt: str, max_tokens: int, model: str) -> str:
    import openai

    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0,
                       timeout=300) as c:
        r = c.chat.completions.create(model=model, temperature=0, max_tokens=max_tokens,
                                      messages=[{"role": "user", "content": prompt}])
    return r.choices[0].message.content or ""


def start(tmp: Path, graph: str, config: str, args: list[str], timeout_s: float
          ) -> tuple[ServeRun, str]:
    run = ServeRun(tmp, graph, "-f", config, *args)
    try:
        ready = run.wait_ready(timeout_s)
    except BaseException:
        run.kill_all()
        raise
    return run, next(r["endpoint"] for r in ready["rows"] if r["component"] == "Frontend")


def gauge(run: ServeRun, component: str, name: str) -> float:
    import httpx

    total = 0.0
    for rep in run.replicas(component):
        if rep["metrics"]:
            for line in httpx.get(rep["metrics"], timeout=10).text.splitlines():
                if line.startswith(name) and not line.startswith("#"):
                    total += float(line.rpartition(" ")[2])
    return total


def wait_for(cond, timeout_s: float, every_s: float = 0.5) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if cond():
                return True
        except Exception:  # noqa: BLE001 - a replica may be restarting
            pass
        time.sleep(every_s)
    return False


def children(pid: int) -> list[int]:
    """Every process below ``pid`` (the engine's scheduler and worker processes)."""
    out: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                for child in map(int, f.read().split()):
                    out += [child, *children(child)]
    except OSError:
        pass
    return out


def check_cancel(run: ServeRun, url: str, model: str) -> tuple[bool, str]:
    import openai

    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0,
                       timeout=300) as c:
        stream = c.completions.create(model=model, prompt="Count from 1 to 1000:",
                                      max_tokens=1000, temperature=0, stream=True,
                                      extra_body={"ignore_eos": True})
        for i, _ in enumerate(stream):
            if i >= 3:
                break
        stream.close()
    t0 = time.monotonic()
    ok = wait_for(lambda: gauge(run, "DecodeWorker", RUNNING) == 0, 60)
    return ok, f"decode engine's request freed after {time.monotonic() - t0:.1f} s"


def check_killed_prefill(run: ServeRun, url: str, model: str, expected: str
                         ) -> tuple[bool, str]:
    pre = next(r for r in run.replicas("PrefillWorker") if r["state"] == "ready")
    victims = [pre["pid"], *children(pre["pid"])]
    with cf.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(lambda: ask_retrying(url, PROMPTS[0], model))
        time.sleep(0.5)
        for pid in victims:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        answer, tries = pending.result(timeout=900)
    restarted = wait_for(lambda: any(r["state"] == "ready" and r["pid"] != pre["pid"]
                                     for r in run.replicas("PrefillWorker")), 900, 2)
    after = ask(url, PROMPTS[0], 32, model) if restarted else ""
    ok = answer == expected and restarted and after == expected
    return ok, (f"answer {'equal' if answer == expected else 'DIFFERENT'} after {tries} "
                f"tries; replica restarted: {restarted}; remote prefill after restart "
                f"{'equal' if after == expected else 'DIFFERENT'}")


def ask_retrying(url: str, prompt: str, model: str, attempts: int = 30) -> tuple[str, int]:
    """A client that retries 503s (Retry-After), as an SGLang graph asks of them while
    its only prefill worker restarts."""
    import openai

    for i in range(1, attempts + 1):
        try:
            return ask(url, prompt, 32, model), i
        except openai.APIStatusError as exc:
            if exc.status_code != 503 or i == attempts:
                raise
            time.sleep(5)
    raise AssertionError("unreachable")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("engine", choices=sorted(ENGINES))
    p.add_argument("--model", required=True, help="local directory of the model (weights "
                   "and tokenizer); the configs' model is Llama 3.1 8B Instruct")
    p.add_argument("--served-model", default="meta-llama/Llama-3.1-8B-Instruct")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--start-timeout-s", type=float, default=1200)
    a = p.parse_args(argv)
    eng, gpus = ENGINES[a.engine], gpu_count()
    if gpus == 0:
        print("no NVIDIA GPU found (nvidia-smi -L)")
        return 2
    rows: list[tuple[str, bool, str]] = []
    tmp = Path(tempfile.mkdtemp(prefix=f"gpu-smoke-{a.engine}-"))

    graph, config, extra = eng.agg
    run, url = start(tmp / "agg", graph, config,
                     [*overrides(eng, eng.agg_sections, a.model, gpus, graph.endswith(
                         "disagg:Frontend"), a.served_model), *extra], a.start_timeout_s)
    try:
        expected = [ask(url, q, a.max_tokens, a.served_model) for q in PROMPTS]
    finally:
        run.stop(timeout_s=120)
    rows.append(("aggregated graph up, answers", all(expected), f"{len(expected)} prompts"))

    graph, config = eng.disagg
    run, url = start(tmp / "disagg", graph, config,
                     [*overrides(eng, ("DecodeWorker", "PrefillWorker"), a.model, gpus, True,
                                 a.served_model),
                      f"--DecodeWorker.disaggregated_router={FORCED_REMOTE}",
                      "--Common.restart.backoff_initial_s=1"], a.start_timeout_s)
    try:
        got = [ask(url, q, a.max_tokens, a.served_model) for q in PROMPTS]
        same = sum(g == e for g, e in zip(got, expected, strict=True))
        rows.append(("disagg == agg (greedy)", same == len(PROMPTS),
                     f"{same}/{len(PROMPTS)} equal"))
        rows.append(("cancellation", *check_cancel(run, url, a.served_model)))
        rows.append(("killed prefill worker",
                     *check_killed_prefill(run, url, a.served_model, expected[0])))
    except Exception as exc:  # noqa: BLE001 - report what failed, then stop the graph
        rows.append(("disaggregated graph", False, f"{type(exc).__name__}: {exc}"))
    finally:
        run.stop(timeout_s=120)

    width = max(len(r[0]) for r in rows)
    print(f"\n{a.engine} on {gpus} GPU(s), logs under {tmp}")
    for name, ok, detail in rows:
        print(f"  {name:<{width}}  {'PASS' if ok else 'FAIL'}  {detail}")
    return 0 if all(ok for _, ok, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
