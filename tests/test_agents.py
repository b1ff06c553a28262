"""Agent frameworks, unmodified, against the service running the demo models: LangGraph's prebuilt ReAct agent over
chat completions and the OpenAI Agents SDK over the Responses API, each with small Python tools and
tool_choice "auto" (the frameworks' default: the demo chat model declares a tool-call format and decides itself
whether to call), and LangChain's structured output filled from what the model knows."""
import asyncio
import json
import random

import httpx
import pytest

from tests.conftest import delete_apps

pytestmark = pytest.mark.serve

FORECASTS = {"Paris": "sunny, 21 C", "Tokyo": "raining, 14 C", "Lima": "cloudy, 19 C"}
POPULATIONS = {"France": "68.2 million", "Japan": "124.5 million", "Peru": "34.1 million"}
calls: list[tuple[str, str]] = []


def get_weather(city: str) -> str:
    """Get the current weather in a city."""
    calls.append(("get_weather", city))
    return FORECASTS.get(city, "clear, 10 C")


def get_population(country: str) -> str:
    """Get the population of a country."""
    calls.append(("get_population", country))
    return POPULATIONS.get(country, "1.0 million")


def get_time(city: str) -> str:
    """Get the local time in a city."""
    calls.append(("get_time", city))
    return "09:30"


@pytest.fixture(scope="module")
def service(serve_url):
    from ray import serve

    from deployments.app import AppArgs, wire

    small = {"ray_actor_options": {"num_cpus": 0.1}}
    options = {"ChatModel": small, "DecisionModel": dict(small, user_config={"max_batch_size": 8}), "Ingress": small}
    serve.run(wire(AppArgs(device="cpu"), options), name="agents", route_prefix="/")
    yield serve_url
    delete_apps("agents")


@pytest.fixture
def llm(service):
    langchain_openai = pytest.importorskip("langchain_openai")
    return langchain_openai.ChatOpenAI(base_url=f"{service}/v1", api_key="unused", model="demo-chat", temperature=0,
                                       max_retries=0, timeout=120)


def test_a_langgraph_react_agent_calls_the_tool_that_fits_and_answers_with_its_result(llm):
    from langgraph.prebuilt import create_react_agent

    agent = create_react_agent(llm, [get_weather, get_population, get_time])
    for question, tool, arg, result in [("What is the weather in Paris?", "get_weather", "Paris", FORECASTS["Paris"]),
                                        ("How many people live in Japan?", "get_population", "Japan",
                                         POPULATIONS["Japan"]),
                                        ("What time is it in Lima?", "get_time", "Lima", "09:30")]:
        calls.clear()
        state = agent.invoke({"messages": [("user", question)]})
        answer = state["messages"][-1]
        assert calls == [(tool, arg)], (question, calls, [m.content for m in state["messages"]])
        assert answer.type == "ai" and not answer.tool_calls and result in answer.content, answer
    calls.clear()
    state = agent.invoke({"messages": [("user", "What is the capital of Peru?")]})      # no tool fits
    assert calls == [] and "Lima" in state["messages"][-1].content


def test_the_openai_agents_sdk_runs_a_tool_using_agent_over_responses(service):
    agents = pytest.importorskip("agents")
    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=f"{service}/v1", api_key="unused", max_retries=0)
    model = agents.OpenAIResponsesModel(model="demo-chat", openai_client=client)
    agent = agents.Agent(name="helper", model=model, tools=[agents.function_tool(get_weather),
                                                            agents.function_tool(get_population)],
                         model_settings=agents.ModelSettings(temperature=0))
    async def run(question):
        calls.clear()
        return (await agents.Runner.run(agent, question)).final_output, list(calls)

    async def both():     # one event loop: the client's connections belong to it
        return await run("What is the weather in Tokyo?"), await run("What is the capital of Japan?")

    (weather, weather_calls), (capital, capital_calls) = asyncio.run(both())
    assert weather_calls == [("get_weather", "Tokyo")] and FORECASTS["Tokyo"] in weather, (weather_calls, weather)
    assert capital_calls == [] and "Tokyo" in capital, (capital_calls, capital)


def test_auto_tool_calls_stream_as_deltas_after_any_text(service):
    """tool_choice "auto" with the demo model: a call streams as OpenAI's tool-call deltas that join into the
    whole reply's call; a question no tool answers gets text and finish_reason stop."""
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city.",
                                               "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                              "required": ["city"]}}}]
    body = {"model": "demo-chat", "messages": [{"role": "user", "content": "What is the weather in Lima?"}],
            "tools": tools, "temperature": 0, "max_tokens": 64}
    whole = httpx.post(f"{service}/v1/chat/completions", json=body, timeout=120).json()["choices"][0]
    assert whole["finish_reason"] == "tool_calls", whole
    [call] = whole["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Lima"}
    arguments, content = "", ""
    with httpx.stream("POST", f"{service}/v1/chat/completions", json=dict(body, stream=True), timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    delta = choice["delta"]
                    content += delta.get("content") or ""
                    for d in delta.get("tool_calls") or ():
                        arguments += d["function"].get("arguments", "")
    assert arguments == call["function"]["arguments"] and content == (whole["message"]["content"] or "")
    plain = httpx.post(f"{service}/v1/chat/completions", timeout=120, json=dict(
        body, messages=[{"role": "user", "content": "What is the capital of France?"}])).json()["choices"][0]
    assert plain["finish_reason"] == "stop" and "Paris" in plain["message"]["content"] and not plain["message"].get(
        "tool_calls")


def test_langchain_structured_output_gets_what_the_model_knows(llm):
    """with_structured_output in its json_schema and function_calling methods on held-out capital questions: the
    right values in a closed object."""
    from pydantic import BaseModel

    class Capital(BaseModel):
        country: str
        capital: str

    from tools.demo_data import CAPITALS, FACT_TEMPLATES

    rng = random.Random(7)
    right = total = 0
    for method in ("json_schema", "function_calling"):
        structured = llm.with_structured_output(Capital, method=method, strict=True)
        for country in rng.sample(sorted(CAPITALS), 6):
            got = structured.invoke(rng.choice(FACT_TEMPLATES).format(c=country))
            right += got is not None and (got.country, got.capital) == (country, CAPITALS[country])
            total += 1
    assert right >= total - 2, (right, total)
