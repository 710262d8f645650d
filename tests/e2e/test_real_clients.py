"""Clients this project did not write, against one live aggregated torch graph with the
real SmolLM2 model on CPU: the official ``openai`` SDK (structured output, tool calls,
logprobs, ``n``, the Responses API), the OpenAI Agents SDK (an agent calling a Python
function tool over the Responses API), LangChain (``bind_tools``,
``with_structured_output``), lm-eval's ``local-completions`` model (a log-likelihood and
a generation task from local data) and aiperf (a short profile).  Each parses our wire
shapes with its own code.

The graph reads tool calls with the ``hermes`` parser.  A 135M-parameter model rarely
decides to call a tool by itself, so the tests that need a call force it (a named
function or ``required``): the engine's structured output then guarantees a valid one.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import openai
import pytest
from pydantic import BaseModel, Field


pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MODEL = "SmolLM2-135M-Instruct"
DATA = Path(__file__).parent / "data" / "lm_eval"
AIPERF = Path(sys.prefix) / "tools" / "aiperf" / "bin" / "aiperf"
# Bounded strings: a small model held to a schema may otherwise write one string until
# max_tokens.
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
           "required": ["city"], "additionalProperties": False}
TOOL = {"type": "function", "function": {"name": "get_weather",
                                         "description": "The weather in a city now",
                                         "parameters": WEATHER}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def url(graph_pool):
    # The README's main graph as it ships: tool_choice auto works without naming a parser
    # (SmolLM2's template renders no tools, so the frontend chooses hermes), and its
    # parsers are imported before the frontend is ready (the default, which the test
    # harness turns off elsewhere).
    return graph_pool.get("graphs.agg:Frontend", "configs/agg.yaml",
                          "--Frontend.preload_parsers=true")[1]


@pytest.fixture(scope="module")
def c(url):
    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0,
                       timeout=120) as client:
        yield client


def model_dir() -> str:
    from splitserve.contracts.kit.cache import model_cache_dir
    from splitserve.contracts.kit.model_dir import export_model_dir, served_model_name

    return str(export_model_dir(model_cache_dir(served_model_name())))


class City(BaseModel):
    name: str = Field(max_length=20)
    country: str = Field(max_length=20)


def test_openai_parse_into_a_pydantic_model(c):
    r = c.chat.completions.parse(
        model=MODEL, response_format=City, max_tokens=48, temperature=0,
        messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert isinstance(r.choices[0].message.parsed, City), r.choices[0].message.content


def test_openai_tool_calls_streamed_and_not(c):
    r = c.chat.completions.create(model=MODEL, messages=ASK, tools=[TOOL], tool_choice=NAMED,
                                  max_tokens=40, temperature=0)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls", ch
    call = ch.message.tool_calls[0]
    assert call.function.name == "get_weather"
    assert set(json.loads(call.function.arguments)) == {"city"}
    args, names, finish = "", [], None
    for chunk in c.chat.completions.create(model=MODEL, messages=ASK, tools=[TOOL],
                                           tool_choice="required", parallel_tool_calls=False,
                                           max_tokens=40, temperature=0, stream=True):
        for d in chunk.choices[0].delta.tool_calls or []:
            names += [d.function.name] if d.function.name else []
            args += d.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert names == ["get_weather"] and finish == "tool_calls"
    assert set(json.loads(args)) == {"city"}
    # The call and its result go back into the history; the model answers in text.
    history = ASK + [ch.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C."}]
    again = c.chat.completions.create(model=MODEL, messages=history, tools=[TOOL],
                                      tool_choice="none", max_tokens=20, temperature=0)
    assert again.choices[0].message.content and not again.choices[0].message.tool_calls


@pytest.mark.deep
def test_openai_auto_tool_choice_parses(c):
    for stream in (False, True):
        r = c.chat.completions.create(model=MODEL, messages=ASK, tools=[TOOL], max_tokens=40,
                                      temperature=0, stream=stream)
        if stream:
            chunks = list(r)
            finish = next(ch.choices[0].finish_reason for ch in reversed(chunks)
                          if ch.choices and ch.choices[0].finish_reason)
            calls = [tc for ch in chunks if ch.choices
                     for tc in ch.choices[0].delta.tool_calls or []]
            assert finish in ("stop", "length", "tool_calls")
            assert (finish == "tool_calls") == bool(calls) or finish == "length"
            continue
        ch = r.choices[0]
        assert ch.finish_reason in ("stop", "length", "tool_calls"), ch
        for call in ch.message.tool_calls or []:
            json.loads(call.function.arguments)


def test_openai_logprobs_and_n(c):
    r = c.chat.completions.create(model=MODEL, messages=ASK, n=2, max_tokens=5, seed=3,
                                  temperature=1.0, logprobs=True, top_logprobs=2)
    assert [ch.index for ch in r.choices] == [0, 1]
    for ch in r.choices:
        assert "".join(t.token for t in ch.logprobs.content) == ch.message.content
        assert all(len(t.top_logprobs) == 2 for t in ch.logprobs.content)


def test_openai_responses_streamed_and_not(c):
    r = c.responses.create(model=MODEL, input="What is the capital of France?",
                           instructions="Answer in one sentence.", max_output_tokens=20,
                           temperature=0)
    assert r.status in ("completed", "incomplete") and r.output_text
    with c.responses.stream(model=MODEL, input="What is the capital of France?",
                            instructions="Answer in one sentence.", max_output_tokens=20,
                            temperature=0) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == r.output_text
    called = c.responses.create(model=MODEL, input="Weather in Paris?", max_output_tokens=40,
                                tools=[{"type": "function", "name": "get_weather",
                                        "parameters": WEATHER, "strict": True}],
                                tool_choice={"type": "function", "name": "get_weather"})
    call = next(o for o in called.output if o.type == "function_call")
    assert call.name == "get_weather" and set(json.loads(call.arguments)) == {"city"}
    # The call and its output go back as input items (stateless: the whole history).
    answer = c.responses.create(
        model=MODEL, max_output_tokens=30, temperature=0, tool_choice="none",
        tools=[{"type": "function", "name": "get_weather", "parameters": WEATHER}],
        input=[{"role": "user", "content": "Weather in Paris?"},
               {"type": "function_call", "call_id": call.call_id, "name": call.name,
                "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id,
                "output": "Sunny, 21 C."}])
    assert answer.output_text and not [o for o in answer.output if o.type == "function_call"]


@pytest.mark.deep
def test_openai_agents_sdk_agent_calls_a_python_tool(url):
    from agents import (
        Agent,
        ModelSettings,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    calls: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city now."""
        calls.append(city)
        return f"Sunny and 21 C in {city}."

    # The tool's result is the answer: left to choose (tool_choice auto) after the
    # result, this small model asks for the weather again at every turn (in the hermes
    # format, which the frontend parses), so running the model again would only reach
    # max_turns.
    async def ask():
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused",
                                      max_retries=0) as client:
            agent = Agent(name="weather", tools=[get_weather],
                          instructions="You answer questions about the weather.",
                          tool_use_behavior="stop_on_first_tool",
                          model=OpenAIResponsesModel(model=MODEL, openai_client=client),
                          model_settings=ModelSettings(tool_choice="get_weather",
                                                       temperature=0, max_tokens=40))
            return await Runner.run(agent, "What is the weather in Paris?", max_turns=2)

    result = asyncio.run(ask())
    assert len(calls) == 1 and result.final_output == f"Sunny and 21 C in {calls[0]}."


@pytest.mark.deep
def test_langchain_bind_tools_and_structured_output(url):
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """The weather in a city now."""
        return "sunny"

    llm = ChatOpenAI(model=MODEL, base_url=f"{url}/v1", api_key="unused", temperature=0,
                     max_tokens=48, max_retries=0)
    msg = llm.bind_tools([get_weather], tool_choice="get_weather").invoke(
        "What is the weather in Paris?")
    assert msg.tool_calls[0]["name"] == "get_weather" and "city" in msg.tool_calls[0]["args"]
    city = llm.with_structured_output(City).invoke("What is the capital of France?")
    assert isinstance(city, City)


def lm_eval_tasks(tmp: Path) -> Path:
    for name in ("capitals_choice.yaml", "capitals_gen.yaml"):
        text = (DATA / name).read_text().replace("DATA/", f"{DATA}/")
        (tmp / name).write_text(text)
    return tmp


@pytest.mark.deep
def test_lm_eval_local_completions_loglikelihood_and_generation(url, tmp_path):
    out = tmp_path / "results"
    args = [sys.executable, "-m", "lm_eval", "--model", "local-completions",
            "--model_args", f"model={MODEL},base_url={url}/v1/completions,"
            f"tokenizer={model_dir()},tokenizer_backend=huggingface,num_concurrent=2,"
            "max_retries=1,timeout=120",
            "--tasks", "splitserve_capitals_choice,splitserve_capitals_gen",
            "--include_path", str(lm_eval_tasks(tmp_path)), "--limit", "4",
            "--output_path", str(out)]
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    res = subprocess.run(args, capture_output=True, text=True, timeout=300, env=env,
                         check=False, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-4000:]
    results = json.loads(next(out.rglob("results_*.json")).read_text())["results"]
    assert 0.0 <= results["splitserve_capitals_choice"]["acc,none"] <= 1.0
    assert "exact_match,none" in results["splitserve_capitals_gen"]


@pytest.mark.deep
def test_aiperf_profiles_the_endpoint(url, tmp_path):
    assert AIPERF.exists(), "aiperf has its own environment: run scripts/setup.sh"
    args = [str(AIPERF), "profile", "--model", MODEL, "--url", url, "--endpoint-type",
            "chat", "--streaming", "--tokenizer", model_dir(), "--request-count", "6",
            "--concurrency", "2", "--isl", "32", "--osl", "8", "--random-seed", "1",
            "--ui-type", "none", "--artifact-dir", str(tmp_path / "aiperf")]
    # Not HF_HUB_OFFLINE: in that mode aiperf 0.13 looks a tokenizer up in the hub cache
    # only and refuses a local directory; a directory is read from disk otherwise.
    env = {k: v for k, v in os.environ.items()
           if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    # aiperf keeps its dataset's memory-mapped files in the temporary folder, and leaves
    # them there: in this test's folder instead
    env["AIPERF_DATASET_MMAP_BASE_PATH"] = str(tmp_path)
    res = subprocess.run(args, capture_output=True, text=True, timeout=300, env=env,
                         check=False, cwd=tmp_path)
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    summary = json.loads(next((tmp_path / "aiperf").rglob("profile_export_aiperf.json"))
                         .read_text())
    assert summary["request_count"]["avg"] == 6, summary.get("request_count")
    assert summary["output_sequence_length"]["avg"] > 0
    assert summary["time_to_first_token"]["count"] == 6
