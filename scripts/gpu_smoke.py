"""One-command GPU smoke test of an engine's graphs: what to run first on a GPU machine.

    python scripts/gpu_smoke.py sglang|trtllm|vllm --model /models/Llama-3.1-8B-Instruct

It brings up the engine's aggregated graph, asks a few prompts greedily (with their
log-probabilities), checks that KV events reach the router (a repeated prompt finds its
prefix), stops it, then brings up the disaggregated graph with remote prefill forced
and checks what clients send:

- equality: every answer equals the aggregated graph's, or first differs at a token
  whose top two log-probabilities there were within ``--tie`` (a bf16 near-tie that
  another kernel order may flip);
- ``min_tokens``: a remotely prefilled request with it answers without falling back to
  a local prefill, as fast as one without (within 2x plus 5 s);
- streamed log-probabilities, a tool call (``tool_choice: required``) and structured
  output (a JSON schema): each answered as asked, or refused with a 4xx naming the
  parameter (what an engine cannot honour after a remote prefill);
- load figures: every decode and prefill replica reports its KV capacity;
- cancellation: a client leaving mid-stream frees the decode engine's request;
- killed prefill worker: with the prefill worker SIGKILLed (its engine processes too),
  a request still gets an answer (SGLang: after the replica restarts, since its decode
  engines cannot prefill) and the restarted replica serves remote prefills again;

and prints a pass/fail table.  Exit status 0 when every check passed.  With one GPU,
prefill and decode share it (Common.allow_shared_devices) at a smaller memory share
each, and start one after the other (the graph starts without its prefill worker, which
is scaled to one once the decode engine has sized its memory: engines that measure free
memory while another loads race); with two or more, the configs' own placement (decode
on GPU 0, prefill on GPU 1) is used.
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
KV_TOTAL = "splitserve_worker_kv_blocks_total"
FALLBACKS = "splitserve_disagg_fallbacks_total"
OVERLAP = "splitserve_router_overlap_blocks_total"
TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}},
          "required": ["city"], "additionalProperties": False}


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


def client(url: str):
    import openai

    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)


Token = tuple[str, float, float | None]
"""A generated token's text, its log-probability and the runner-up's (None: no other)."""


def ask_with_logprobs(url: str, prompt: str, max_tokens: int, model: str
                      ) -> tuple[str, list[Token]]:
    """A greedy answer and, per token, its log-probability and the runner-up's."""
    with client(url) as c:
        r = c.chat.completions.create(model=model, temperature=0, max_tokens=max_tokens,
                                      logprobs=True, top_logprobs=2,
                                      messages=[{"role": "user", "content": prompt}])
    choice = r.choices[0]
    tokens: list[Token] = []
    for t in (choice.logprobs.content if choice.logprobs else None) or ():
        others = [x.logprob for x in t.top_logprobs or () if x.token != t.token]
        tokens.append((t.token, t.logprob, max(others) if others else None))
    return choice.message.content or "", tokens


def same_or_near_tie(reference: str, tokens: list[Token], other: str, tie: float
                     ) -> tuple[bool, str]:
    """Whether ``other`` equals ``reference``, or first differs within a token where the
    reference's top two log-probabilities were within ``tie`` (a near-tie bf16 may flip:
    everything after it may differ)."""
    if other == reference:
        return True, "equal"
    at = next((i for i, (a, b) in enumerate(zip(reference, other, strict=False)) if a != b),
              min(len(reference), len(other)))
    start = 0
    for i, (text, lp, runner_up) in enumerate(tokens):
        if start <= at < start + max(1, len(text)):
            if runner_up is not None and lp - runner_up <= tie:
                return True, f"near-tie at token {i} (gap {lp - runner_up:.3f})"
            gap = "no runner-up" if runner_up is None else f"gap {lp - runner_up:.3f}"
            return False, f"differs at token {i} ({gap})"
        start += len(text)
    return False, f"differs at character {at}, past the reference's tokens"


def refused_by_name(exc: Exception, name: str) -> bool:
    """A 4xx whose message names the parameter (an engine that cannot honour it)."""
    import openai

    return (isinstance(exc, openai.APIStatusError) and 400 <= exc.status_code < 500
            and name in str(exc))


def check_min_tokens(run: ServeRun, url: str, model: str) -> tuple[bool, str]:
    fallbacks = gauge(run, "DecodeWorker", FALLBACKS)
    with client(url) as c:
        def timed(**extra) -> tuple[float, int]:
            t0 = time.monotonic()
            r = c.chat.completions.create(model=model, temperature=0, max_tokens=16,
                                          extra_body=extra, messages=[
                                              {"role": "user", "content": PROMPTS[1]}])
            return time.monotonic() - t0, r.usage.completion_tokens
        plain, _ = timed()
        with_min, produced = timed(min_tokens=8)
    fell_back = gauge(run, "DecodeWorker", FALLBACKS) - fallbacks
    ok = produced >= 8 and fell_back == 0 and with_min < 2 * plain + 5
    return ok, (f"{produced} tokens, {with_min:.1f} s against {plain:.1f} s without, "
                f"{fell_back:g} fallbacks")


def check_streamed_logprobs(url: str, model: str) -> tuple[bool, str]:
    try:
        with client(url) as c:
            stream = c.chat.completions.create(
                model=model, temperature=0, max_tokens=12, logprobs=True, top_logprobs=2,
                stream=True, stream_options={"include_usage": True},
                messages=[{"role": "user", "content": PROMPTS[3]}])
            entries, produced = 0, None
            for chunk in stream:
                for ch in chunk.choices:
                    entries += len((ch.logprobs.content if ch.logprobs else None) or ())
                if chunk.usage is not None:
                    produced = chunk.usage.completion_tokens
    except Exception as exc:  # noqa: BLE001 - a refusal by name is an answer too
        if refused_by_name(exc, "logprobs"):
            return True, f"refused by name: {str(exc)[:120]}"
        return False, f"{type(exc).__name__}: {str(exc)[:200]}"
    return entries == produced and entries > 0, f"{entries} logprobs for {produced} tokens"


def check_tool_call(url: str, model: str) -> tuple[bool, str]:
    import json

    try:
        with client(url) as c:
            r = c.chat.completions.create(
                model=model, temperature=0, max_tokens=64, tools=[TOOL],
                tool_choice="required", parallel_tool_calls=False,
                messages=[{"role": "user", "content": "What is the weather in Paris?"}])
    except Exception as exc:  # noqa: BLE001
        if refused_by_name(exc, "tool"):
            return True, f"refused by name: {str(exc)[:120]}"
        return False, f"{type(exc).__name__}: {str(exc)[:200]}"
    calls = r.choices[0].message.tool_calls or []
    if len(calls) != 1 or calls[0].function.name != "get_weather":
        return False, f"calls: {calls!r:.200}"
    args = json.loads(calls[0].function.arguments)
    return isinstance(args.get("city"), str), f"get_weather({args})"


def check_structured(url: str, model: str) -> tuple[bool, str]:
    import json

    try:
        with client(url) as c:
            r = c.chat.completions.create(
                model=model, temperature=0, max_tokens=64,
                response_format={"type": "json_schema", "json_schema": {
                    "name": "city", "schema": SCHEMA, "strict": True}},
                messages=[{"role": "user", "content": "Name the capital of France."}])
    except Exception as exc:  # noqa: BLE001
        if refused_by_name(exc, "response_format"):
            return True, f"refused by name: {str(exc)[:120]}"
        return False, f"{type(exc).__name__}: {str(exc)[:200]}"
    text = r.choices[0].message.content or ""
    try:
        value = json.loads(text)
    except ValueError:
        return False, f"not JSON: {text[:120]!r}"
    return set(value) == {"city"} and isinstance(value["city"], str), text[:120]


def check_load(run: ServeRun) -> tuple[bool, str]:
    totals = {c: gauge(run, c, KV_TOTAL) for c in ("DecodeWorker", "PrefillWorker")}
    return all(v > 0 for v in totals.values()), ", ".join(
        f"{c}: {v:g} KV blocks" for c, v in totals.items())


def check_kv_events(run: ServeRun, url: str, model: str) -> tuple[bool, str]:
    """A repeated prompt finds its prefix in the router's index: the engine's KV events
    reached it."""
    prompt = " ".join(PROMPTS * 8)  # several KV blocks long
    before = gauge(run, "Router", OVERLAP)
    ask(url, prompt, 4, model)

    def again_found() -> bool:  # the events may arrive after the first answer
        ask(url, prompt, 4, model)
        return gauge(run, "Router", OVERLAP) > before

    found = wait_for(again_found, 30, 2)
    return found, f"overlap blocks {gauge(run, 'Router', OVERLAP) - before:g}"


def ask(url: str, prompt: str, max_tokens: int, model: str) -> str:
    with client(url) as c:
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


def scale_up(run: ServeRun, component: str, timeout_s: float) -> None:
    """One replica of ``component`` through the run's control API, then wait for it."""
    import httpx

    r = httpx.post(run.control() + f"/v1/components/{component}/replicas",
                   json={"replicas": 1}, timeout=30,
                   headers={"authorization": f"Bearer {run.token()}"})
    r.raise_for_status()
    if not wait_for(lambda: any(x["state"] == "ready" for x in run.replicas(component)),
                    timeout_s, 2):
        raise RuntimeError(f"{component} not ready within {timeout_s:.0f} s")


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
    with client(url) as c:
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
    p.add_argument("--tie", type=float, default=0.1, help="a first difference from the "
                   "aggregated answer passes where its top two log-probabilities were "
                   "within this (bf16 near-tie)")
    a = p.parse_args(argv)
    eng, gpus = ENGINES[a.engine], gpu_count()
    if gpus == 0:
        print("no NVIDIA GPU found (nvidia-smi -L)")
        return 2
    rows: list[tuple[str, bool, str]] = []
    tmp = Path(tempfile.mkdtemp(prefix=f"gpu-smoke-{a.engine}-"))

    graph, config, extra = eng.agg
    split = graph.endswith("disagg:Frontend")
    run, url = start(tmp / "agg", graph, config,
                     [*overrides(eng, eng.agg_sections, a.model, gpus, split, a.served_model),
                      *extra], a.start_timeout_s)
    try:
        reference = [ask_with_logprobs(url, q, a.max_tokens, a.served_model) for q in PROMPTS]
        if not split:  # a graph with a Router: its index must hear the engine's events
            rows.append(("KV events reach the router",
                         *check_kv_events(run, url, a.served_model)))
    finally:
        run.stop(timeout_s=120)
    rows.append(("aggregated graph up, answers", all(t for t, _ in reference),
                 f"{len(reference)} prompts"))

    graph, config = eng.disagg
    staggered = gpus < 2  # one GPU: the prefill engine starts once the decode one is up
    run, url = start(tmp / "disagg", graph, config,
                     [*overrides(eng, ("DecodeWorker", "PrefillWorker"), a.model, gpus, True,
                                 a.served_model),
                      f"--DecodeWorker.disaggregated_router={FORCED_REMOTE}",
                      "--Common.restart.backoff_initial_s=1",
                      *(["--PrefillWorker.replicas=0"] if staggered else [])],
                     a.start_timeout_s)
    try:
        if staggered:
            scale_up(run, "PrefillWorker", a.start_timeout_s)
        got = [ask(url, q, a.max_tokens, a.served_model) for q in PROMPTS]
        judged = [same_or_near_tie(ref, toks, g, a.tie)
                  for (ref, toks), g in zip(reference, got, strict=True)]
        rows.append(("disagg == agg (greedy, bf16 near-ties allowed)",
                     all(ok for ok, _ in judged), "; ".join(d for _, d in judged)))
        rows.append(("min_tokens, remotely prefilled",
                     *check_min_tokens(run, url, a.served_model)))
        rows.append(("streamed log-probabilities", *check_streamed_logprobs(url, a.served_model)))
        rows.append(("tool call (required)", *check_tool_call(url, a.served_model)))
        rows.append(("structured output (JSON schema)", *check_structured(url, a.served_model)))
        rows.append(("load figures, decode and prefill", *check_load(run)))
        rows.append(("cancellation", *check_cancel(run, url, a.served_model)))
        rows.append(("killed prefill worker",
                     *check_killed_prefill(run, url, a.served_model, got[0])))
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
