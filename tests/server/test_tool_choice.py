"""tool_choice through the OpenAI API (issue 27 item 2), on the small trained models (models/<family>/)
with their own tool-call parsers: "required" and a named function force a call in the model's markup
(src/server/parsers/tool_grammar.cpp), so over several seeds every answer is a call to an offered tool
whose arguments validate against its schema (jsonschema), streamed and not alike; "none" shows no markup
and no call; with reasoning on, the reasoning comes first, then the call (or a response_format's JSON),
for every answer that closed its reasoning with the end tag the grammar waits for."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import httpx

from sparrow_server import API_KEY, MODEL_NAME
from test_trained_models import PARSERS, join_stream, trained_models

try:
    import jsonschema
except ImportError:
    jsonschema = None

REPO = Path(__file__).resolve().parents[2]
# The tool-call formats' markers (test_trained_models.MARKUP also lists the chat templates' and reasoning's).
TOOL_CALL_MARKUP = ("tool▁call", "tool_call", "<minimax:", "<invoke", "]<]")
sys.path.insert(0, str(REPO / "tools"))
SEEDS = [1, 2, 3, 4]


def question():
    from chat_corpus import demo_conversation
    messages, tools = demo_conversation()
    first_answer = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    return messages[:first_answer], tools


def thinking(on: bool) -> dict:
    # Every template's switch: Kimi `thinking`, DeepSeek `enable_thinking`, MiniMax-M3 `thinking_mode`.
    return {"thinking": on, "enable_thinking": on, "thinking_mode": "enabled" if on else "disabled"}


# Each reasoning parser's end tag: the grammar starts after it (docs/server.md, "Reasoning first").
END_OF_REASONING = {"deepseek_v32": "</think>", "minimax_m3": "</mm:think>", "kimi_k3": "<|close|>think<|sep|>"}


def closed_reasoning(server, token_ids: list[int]) -> bool:
    """The output holds the reasoning's end tag as the tokens the grammar waits for. An answer without it
    never started its grammar (the model may end, or open a tool section, inside its reasoning: vLLM's
    reasoning-aware structured outputs leave such output unconstrained too), so it gives no verdict."""
    marker = httpx.post(server.url + "/tokenize", headers={"Authorization": f"Bearer {API_KEY}"},
                        json={"model": MODEL_NAME, "prompt": END_OF_REASONING[server.parser],
                              "add_special_tokens": False}).json()["tokens"]
    return any(token_ids[i:i + len(marker)] == marker for i in range(len(token_ids)))


def check_call(call, tools, only: str | None = None) -> None:
    by_name = {t["function"]["name"]: t["function"] for t in tools}
    assert call.function.name in by_name, call.function.name
    if only:
        assert call.function.name == only
    arguments = json.loads(call.function.arguments)
    schema = by_name[call.function.name]["parameters"]
    if jsonschema:
        jsonschema.validate(arguments, schema)
    else:
        assert isinstance(arguments, dict) and set(schema["required"]) <= set(arguments)


@pytest.fixture(scope="module", params=trained_models() or [None], ids=lambda p: p.name if p else "none")
def tool_server(request, start_server):
    model = request.param
    if model is None:
        pytest.skip("no trained model in models/")
    parser = PARSERS[json.loads((model / "config.json").read_text())["model_type"]]
    server = start_server("--api-key", API_KEY, "--tool-call-parser", parser, "--reasoning-parser", parser,
                          "--enable-auto-tool-choice", "--kv-cache-memory", "512MiB", model=model)
    server.parser = parser
    return server


@pytest.mark.parametrize("choice", ["required", "named"])
def test_forced_calls_are_valid_streamed_or_not(tool_server, choice):
    messages, tools = question()
    client = tool_server.client(timeout=300)
    only = tools[-1]["function"]["name"] if choice == "named" else None
    tool_choice = {"type": "function", "function": {"name": only}} if only else "required"
    for seed in SEEDS:
        request = dict(model=MODEL_NAME, messages=messages, tools=tools, tool_choice=tool_choice, max_tokens=200,
                       temperature=1.0, seed=seed, extra_body={"chat_template_kwargs": thinking(False)})
        full = client.chat.completions.create(**request)
        choice_out = full.choices[0]
        assert choice_out.finish_reason == ("tool_calls" if choice == "required" else "stop"), choice_out
        calls = choice_out.message.tool_calls or []
        assert len(calls) >= 1, choice_out.message
        for call in calls:
            check_call(call, tools, only)
        assert not choice_out.message.content
        streamed = join_stream(client.chat.completions.create(**request, stream=True))
        assert streamed["finish"] == choice_out.finish_reason
        assert [(c["name"], c["arguments"]) for c in streamed["message"]["tool_calls"]] == \
            [(c.function.name, c.function.arguments) for c in calls]


def test_parallel_calls_off_gives_one_call(tool_server):
    messages, tools = question()
    client = tool_server.client(timeout=300)
    for seed in SEEDS[:2]:
        full = client.chat.completions.create(
            model=MODEL_NAME, messages=messages, tools=tools, tool_choice="required", parallel_tool_calls=False,
            max_tokens=200, temperature=1.0, seed=seed, extra_body={"chat_template_kwargs": thinking(False)})
        assert len(full.choices[0].message.tool_calls) == 1


def test_none_shows_no_markup_and_no_call(tool_server):
    messages, tools = question()
    client = tool_server.client(timeout=300)
    for seed in SEEDS:
        request = dict(model=MODEL_NAME, messages=messages, tools=tools, tool_choice="none", max_tokens=120,
                       temperature=1.0, seed=seed)
        full = client.chat.completions.create(**request)
        message = full.choices[0].message
        assert not message.tool_calls
        assert full.choices[0].finish_reason in ("stop", "length")
        # No tool-call markup: its special tokens are never sampled. (A tiny model sampled at temperature 1 may
        # still emit the chat template's other special tokens, which the parsers leave in content.)
        assert not any(marker in (message.content or "") for marker in TOOL_CALL_MARKUP), message.content
        streamed = join_stream(client.chat.completions.create(**request, stream=True))
        assert streamed["message"]["tool_calls"] == []
        assert streamed["message"]["content"] == (message.content or "")


def test_reasoning_comes_before_the_forced_call(tool_server):
    messages, tools = question()
    client = tool_server.client(timeout=300)
    reasoned = 0
    for seed in SEEDS:
        full = client.chat.completions.create(
            model=MODEL_NAME, messages=messages, tools=tools, tool_choice="required", max_tokens=230,
            temperature=0.7, seed=seed,
            extra_body={"chat_template_kwargs": thinking(True), "return_token_ids": True})
        choice = full.choices[0]
        if not closed_reasoning(tool_server, choice.model_extra["token_ids"]):
            continue
        assert choice.finish_reason == "tool_calls", choice
        for call in choice.message.tool_calls:
            check_call(call, tools)
        reasoning = choice.message.model_extra.get("reasoning") or ""
        assert not any(marker in reasoning for marker in ("<|", "</think>")), reasoning
        reasoned += bool(reasoning.strip())
    assert reasoned >= 1, "no answer reasoned before its call"


def test_unsupported_tool_schema_is_a_400_naming_the_tool(tool_server):
    import openai
    messages, _ = question()
    bad = [{"type": "function", "function": {"name": "odd", "parameters": {
        "type": "object", "properties": {"x": {"not": {"type": "string"}}}}}}]
    with pytest.raises(openai.BadRequestError) as error:
        tool_server.client().chat.completions.create(model=MODEL_NAME, messages=messages, tools=bad,
                                                     tool_choice="required", max_tokens=20)
    assert "odd" in str(error.value)


def test_forced_call_with_response_format_is_a_400(tool_server):
    import openai
    messages, tools = question()
    with pytest.raises(openai.BadRequestError) as error:
        tool_server.client().chat.completions.create(model=MODEL_NAME, messages=messages, tools=tools,
                                                     tool_choice="required", max_tokens=20,
                                                     response_format={"type": "json_object"})
    assert "tool_choice" in str(error.value)


def test_response_format_starts_after_the_reasoning(tool_server):
    # The structured output's grammar waits for the reasoning's end tag: the reasoning is free text and
    # the content is the JSON (before, the grammar covered the reasoning too and none came back).
    messages, _ = question()
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 20}}, "required": ["answer"]}
    client = tool_server.client(timeout=300)
    reasoned = 0
    for seed in SEEDS:
        full = client.chat.completions.create(
            model=MODEL_NAME, messages=messages, max_tokens=230, temperature=0.7, seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
            extra_body={"chat_template_kwargs": thinking(True), "return_token_ids": True})
        choice = full.choices[0]
        if choice.finish_reason == "length" or not closed_reasoning(tool_server, choice.model_extra["token_ids"]):
            continue
        value = json.loads(choice.message.content)
        if jsonschema:
            jsonschema.validate(value, schema)
        reasoned += bool((choice.message.model_extra.get("reasoning") or "").strip())
        assert choice.finish_reason == "stop"
    assert reasoned >= 1, "no answer reasoned before its JSON"
