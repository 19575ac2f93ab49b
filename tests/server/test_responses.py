"""POST /v1/responses (OpenAI's Responses API as vLLM serves it; issue 27 item 4) through the official
`openai` client (responses.create, streamed, responses.stream and responses.parse) and httpx for what the
client cannot send. The endpoint shares the chat path (src/server/chat_prompt.h), so the checks compare
it with /v1/chat/completions and /tokenize: the same prompt tokens and the same greedy text. On the
small trained models (models/<family>/, with their own parsers): text.format JSON schemas always parse
and validate, tool_choice "required" and named always give a valid function_call, tool results go back
as function_call_output items, and reasoning comes back as a reasoning item."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx
import openai
import pytest

from sparrow_server import API_KEY, MODEL_NAME, wait_until
from test_tool_choice import END_OF_REASONING, thinking
from test_trained_models import MARKUP, PARSERS, trained_models

try:
    import jsonschema
except ImportError:  # checked by hand below
    jsonschema = None

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))
HEADERS = {"Authorization": f"Bearer {API_KEY}"}
GREEDY = dict(temperature=0)
SEEDS = [1, 2, 3, 4]
DEEPSEEK = REPO / "models" / "deepseek_v32"
PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0},
                         "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 2}},
          "required": ["name", "age"], "additionalProperties": False}


def post(server, path, body, **kwargs):
    return httpx.post(server.url + path, json=body, headers=HEADERS, timeout=60, **kwargs)


def prompt_ids(server, messages, **extra) -> list[int]:
    """The token ids the chat path renders `messages` to (/tokenize, chat form)."""
    response = post(server, "/tokenize", {"messages": messages, **extra})
    assert response.status_code == 200, response.text
    return response.json()["tokens"]


def flat_tools(chat_tools):
    """Chat tools ({"type": "function", "function": {...}}) in the Responses API's flat shape."""
    return [{"type": "function", **tool["function"]} for tool in chat_tools]


def question():
    from chat_corpus import demo_conversation
    messages, tools = demo_conversation()
    first_answer = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    return messages[:first_answer], tools


def collect(stream) -> list:
    events = list(stream)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1].type in ("response.completed", "response.incomplete")
    return events


def streamed_output(events) -> list[dict]:
    """The output items the deltas of a stream build, checked against the items' done events."""
    items = {}
    for e in events:
        if e.type == "response.output_item.added":
            items[e.output_index] = {"type": e.item.type, "id": e.item.id, "text": "", "done": None}
        elif e.type in ("response.output_text.delta", "response.reasoning_text.delta",
                        "response.function_call_arguments.delta"):
            assert items[e.output_index]["id"] == e.item_id
            items[e.output_index]["text"] += e.delta
        elif e.type == "response.output_item.done":
            items[e.output_index]["done"] = e.item.model_dump()
    for item in items.values():
        done = item["done"]
        assert done is not None and done["id"] == item["id"], item
        if item["type"] == "function_call":
            assert done["arguments"] == item["text"]
        else:
            assert done["content"][0]["text"] == item["text"]
    return [items[i]["done"] for i in sorted(items)]


def check_call(call, tools, only: str | None = None) -> None:
    by_name = {t["name"]: t for t in tools}
    assert call.type == "function_call" and call.call_id and call.id.startswith("fc_")
    assert call.name in by_name and (only is None or call.name == only), call.name
    arguments = json.loads(call.arguments)
    schema = by_name[call.name]["parameters"]
    if jsonschema:
        jsonschema.validate(arguments, schema)
    else:
        assert isinstance(arguments, dict) and set(schema["required"]) <= set(arguments)


def check_person(text: str) -> None:
    value = json.loads(text)
    if jsonschema:
        jsonschema.validate(value, PERSON)
    else:
        assert isinstance(value["name"], str) and isinstance(value["age"], int) and set(value) <= set(PERSON["properties"])


# --- text, on the test model ------------------------------------------------------------------------

def test_text_response_is_the_chat_completion(server):
    client = server.client()
    response = client.responses.create(model=MODEL_NAME, input="Hello, who are you?", max_output_tokens=8, **GREEDY)
    assert response.object == "response" and response.id.startswith("resp_") and response.model == MODEL_NAME
    assert response.status in ("completed", "incomplete")
    [message] = response.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert message.content[0].type == "output_text" and message.content[0].annotations == []
    # The same prompt and the same greedy text as /v1/chat/completions.
    messages = [{"role": "user", "content": "Hello, who are you?"}]
    chat = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=8, **GREEDY)
    assert response.output_text == chat.choices[0].message.content
    usage = response.usage
    assert usage.input_tokens == len(prompt_ids(server, messages)) == chat.usage.prompt_tokens
    assert usage.output_tokens == chat.usage.completion_tokens
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.input_tokens_details.cached_tokens >= 0 and usage.output_tokens_details.reasoning_tokens == 0


def test_input_items_render_as_chat_messages(server):
    """instructions, developer / system / user / assistant items with text parts, an assistant
    function_call and its function_call_output: the prompt is that of the equivalent chat messages."""
    client = server.client()
    items = [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather?"},
                                                         {"type": "input_text", "text": "In Lyon."}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Lyon"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"type": "message", "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": "It is sunny.", "annotations": []}]},
        {"role": "user", "content": "Thanks"},
    ]
    response = client.responses.create(model=MODEL_NAME, instructions="You answer questions.", input=items,
                                       max_output_tokens=2, **GREEDY)
    messages = [
        {"role": "system", "content": "You answer questions."},
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?\nIn Lyon."},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Lyon"}'}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1", "name": "get_weather"},
        {"role": "assistant", "content": "It is sunny."},
        {"role": "user", "content": "Thanks"},
    ]
    assert response.usage.input_tokens == len(prompt_ids(server, messages))
    assert response.instructions == "You answer questions."


def test_parameters_are_echoed(server):
    response = server.client().responses.create(
        model=MODEL_NAME, input="Hi", instructions="Be nice.", max_output_tokens=3, temperature=0.7, top_p=0.9,
        metadata={"run": "42"}, user="u-1", store=True, text={"format": {"type": "text"}}, extra_body={"seed": 3})
    assert response.instructions == "Be nice." and response.metadata == {"run": "42"} and response.user == "u-1"
    assert response.temperature == 0.7 and response.top_p == 0.9 and response.max_output_tokens == 3
    assert response.parallel_tool_calls is True and response.tool_choice == "none" and response.tools == []
    assert response.text.format.type == "text" and response.previous_response_id is None
    assert response.truncation == "disabled" and response.error is None


def test_max_output_tokens_makes_it_incomplete(server):
    response = server.client().responses.create(model=MODEL_NAME, input="Count:", max_output_tokens=3,
                                                extra_body={"ignore_eos": True}, **GREEDY)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 3 and response.output[-1].status == "incomplete"


def test_stream_builds_the_same_response(server):
    client = server.client()
    request = dict(model=MODEL_NAME, input="Tell me a story.", max_output_tokens=12, **GREEDY)
    whole = client.responses.create(**request)
    events = collect(client.responses.create(stream=True, **request))
    created, final = events[0].response, events[-1].response
    assert created.status == "in_progress" and created.output == [] and created.id == final.id
    items = streamed_output(events)
    assert items == [item.model_dump() for item in final.output]
    assert final.output_text == whole.output_text and final.status == whole.status
    assert final.usage.model_dump() == whole.usage.model_dump()
    kinds = [e.type for e in events]
    assert kinds[2:5] == ["response.output_item.added", "response.content_part.added", "response.output_text.delta"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    # The client's own accumulator takes it (it checks the items' ids and order as they come).
    with client.responses.stream(**request) as stream:
        last = list(stream)[-1]
    assert last.type == "response.incomplete" and last.response.output_text == whole.output_text


def test_logprobs_go_with_the_text(server):
    response = server.client().responses.create(model=MODEL_NAME, input="Hi", max_output_tokens=5, top_logprobs=2,
                                                include=["message.output_text.logprobs"], **GREEDY)
    part = response.output[0].content[0]
    assert len(part.logprobs) == response.usage.output_tokens
    for entry in part.logprobs:
        assert len(entry.top_logprobs) == 2 and entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)


def test_listed_in_openapi(server):
    operation = httpx.get(server.url + "/openapi.json").json()["paths"]["/v1/responses"]["post"]
    assert "Responses API" in operation["summary"] and "application/json" in operation["requestBody"]["content"]


# --- errors -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("body, param, words", [
    ({"input": [{"type": "web_search_call", "id": "x"}]}, "input[0].type", "web_search_call"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type", "store"),
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id", "store"),
    ({"input": "hi", "conversation": "conv_1"}, "conversation", "store"),
    ({"input": "hi", "background": True}, "background", "background"),
    ({"input": "hi", "text": {"format": {"type": "xml"}}}, "text.format.type", "json_schema"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "a"}}}, "text.format.schema", "required"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "a", "schema": {"type": "nonsense"}}}},
     "text.format.schema", "invalid"),
    ({"input": "hi", "max_tokens": 5}, "max_tokens", "Unknown parameter"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type", "function tools"),
    ({"input": "hi", "tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function", "name": "g"}},
     "tool_choice.name", "'g'"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].image_url", "takes no images"),  # this model has no vision tower (test_images.py)
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
     "input[0].content[0].type", "not supported"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role", "user"),
    ({"input": []}, "input", "empty"),
    ({}, "input", "required"),
    ({"input": "hi", "temperature": -1}, "temperature", ">= 0"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens", "at least 1"),
    ({"input": "hi", "truncation": "auto"}, "truncation", "fits"),
    ({"input": "hi", "reasoning": {"effort": "extreme"}}, "reasoning.effort", "one of"),
    ({"input": "hi", "metadata": {"k": 1}}, "metadata", "strings"),
])
def test_bad_requests_are_400_naming_the_field(server, body, param, words):
    response = post(server, "/v1/responses", {"model": MODEL_NAME, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "BadRequestError" and error["code"] == 400 and error["param"] == param, error
    assert words in error["message"], error


def test_unknown_model_and_tool_choice_without_parser(server):
    client = server.client()
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="nope", input="hi")
    with pytest.raises(openai.BadRequestError) as error:  # "auto" needs --enable-auto-tool-choice, as for chat
        client.responses.create(model=MODEL_NAME, input="hi", tools=[{"type": "function", "name": "f"}])
    assert "--enable-auto-tool-choice" in str(error.value)


def test_stream_disconnect_aborts_the_request(start_server):
    if not (DEEPSEEK / "config.json").exists():
        pytest.skip("the trained model models/deepseek_v32 is not present")
    server = start_server("--api-key", API_KEY, model=DEEPSEEK, log_requests=True)
    aborted = 'vllm:request_success_total{finished_reason="abort"}'
    with httpx.stream("POST", server.url + "/v1/responses", headers=HEADERS, timeout=60,
                      json={"model": MODEL_NAME, "input": "hi", "max_output_tokens": 1000, "ignore_eos": True,
                            "stream": True}) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        lines = response.iter_lines()
        assert next(lines) == "event: response.created"
    settled = lambda: (m := server.metrics())["vllm:num_requests_running"] == 0 and m[aborted] >= 1
    assert wait_until(settled, timeout_s=15), server.metrics()
    assert wait_until(lambda: any("POST /v1/responses 200" in line and "resp_" in line and "(client gone)" in line
                                  for line in server.stderr)), server.output()


# --- structured text, tools and reasoning on the trained models ------------------------------------

@pytest.fixture(scope="module")
def json_server(start_server):
    if not (DEEPSEEK / "config.json").exists():
        pytest.skip("the trained model models/deepseek_v32 is not present")
    return start_server("--api-key", API_KEY, model=DEEPSEEK)


def test_json_schema_text_format_always_validates(json_server):
    client = json_server.client(timeout=300)
    text = {"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}}
    for seed in SEEDS:
        request = dict(model=MODEL_NAME, input="Describe a person as JSON.", max_output_tokens=200, temperature=1.0,
                       text=text, extra_body={"seed": seed})
        response = client.responses.create(**request)
        assert response.status == "completed", response.output_text
        check_person(response.output_text)
        assert response.text.format.type == "json_schema"
        final = collect(client.responses.create(stream=True, **request))[-1].response
        assert final.output_text == response.output_text
        with client.responses.stream(**request) as stream:  # the client's accumulator, to response.completed
            assert stream.get_final_response().output_text == response.output_text
    # json_object: any object; a sampled one may outgrow max_output_tokens ("incomplete"), every complete one parses.
    completed = 0
    for seed in SEEDS:
        response = client.responses.create(model=MODEL_NAME, input="JSON please", max_output_tokens=200,
                                           text={"format": {"type": "json_object"}}, extra_body={"seed": seed})
        assert response.status in ("completed", "incomplete"), response.status
        if response.status == "completed":
            assert isinstance(json.loads(response.output_text), dict)
            completed += 1
    assert completed > 0


def test_responses_parse_with_a_pydantic_model(json_server):
    from pydantic import BaseModel, Field

    class Pet(BaseModel):
        name: str = Field(max_length=10)
        legs: int = Field(ge=0, le=8)

    parsed = json_server.client(timeout=300).responses.parse(model=MODEL_NAME, input="A pet as JSON.",
                                                             max_output_tokens=120, text_format=Pet,
                                                             extra_body={"seed": 2})
    assert isinstance(parsed.output_parsed, Pet)


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
def test_forced_tool_choice_always_gives_a_valid_call(tool_server, choice):
    messages, chat_tools = question()
    tools = flat_tools(chat_tools)
    only = tools[-1]["name"] if choice == "named" else None
    tool_choice = {"type": "function", "name": only} if only else "required"
    client = tool_server.client(timeout=300)
    for seed in SEEDS:
        request = dict(model=MODEL_NAME, input=messages, tools=tools, tool_choice=tool_choice, max_output_tokens=200,
                       temperature=1.0, extra_body={"seed": seed, "chat_template_kwargs": thinking(False)})
        response = client.responses.create(**request)
        calls = [item for item in response.output if item.type == "function_call"]
        assert response.status == "completed" and calls, response.output
        for call in calls:
            check_call(call, tools, only)
            assert call.status == "completed"
        assert response.tool_choice == tool_choice or response.tool_choice.name == only
        events = collect(client.responses.create(stream=True, **request))
        streamed = [i for i in streamed_output(events) if i["type"] == "function_call"]
        assert [(c["name"], c["arguments"]) for c in streamed] == [(c.name, c.arguments) for c in calls]


def test_tool_round_trip_with_function_call_output(tool_server):
    """The calls of one response, with their results as function_call_output items, go back as the next
    input (the pattern of OpenAI's function-calling guide): the prompt is the chat path's for the same turn."""
    messages, chat_tools = question()
    tools = flat_tools(chat_tools)
    client = tool_server.client(timeout=300)
    first = client.responses.create(model=MODEL_NAME, input=messages, tools=tools, tool_choice="required",
                                    parallel_tool_calls=False, max_output_tokens=200, temperature=0,
                                    extra_body={"chat_template_kwargs": thinking(False)})
    [call] = [item for item in first.output if item.type == "function_call"]
    items = list(messages) + [item.model_dump(exclude_none=True) for item in first.output]
    items.append({"type": "function_call_output", "call_id": call.call_id, "output": '{"result": 816}'})
    second = client.responses.create(model=MODEL_NAME, input=items, tools=tools, max_output_tokens=40, temperature=0,
                                     extra_body={"chat_template_kwargs": thinking(False)})
    assert second.status in ("completed", "incomplete") and second.output
    for item in second.output:
        if item.type == "message":
            assert not any(marker in item.content[0].text for marker in MARKUP), item
    chat_messages = list(messages) + [
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": call.call_id, "type": "function",
                         "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "content": '{"result": 816}', "tool_call_id": call.call_id, "name": call.name}]
    expected = prompt_ids(tool_server, chat_messages, tools=chat_tools, chat_template_kwargs=thinking(False))
    assert second.usage.input_tokens == len(expected)


def test_reasoning_comes_back_as_a_reasoning_item(tool_server):
    messages, _ = question()
    client = tool_server.client(timeout=300)
    request = dict(model=MODEL_NAME, input=messages, max_output_tokens=200, temperature=0,
                   reasoning={"effort": "high"}, extra_body={"chat_template_kwargs": thinking(True)})
    response = client.responses.create(**request)
    assert response.reasoning.effort == "high"
    reasoning = [item for item in response.output if item.type == "reasoning"]
    assert len(reasoning) == 1 and response.output[0] is reasoning[0], response.output
    text = reasoning[0].content[0].text
    assert text.strip() and reasoning[0].summary == [] and reasoning[0].id.startswith("rs_")
    assert END_OF_REASONING[tool_server.parser] not in text and "<|" not in text
    assert response.usage.output_tokens_details.reasoning_tokens > 0
    events = collect(client.responses.create(stream=True, **request))
    assert "response.reasoning_text.delta" in {e.type for e in events}
    assert streamed_output(events)[0]["content"][0]["text"] == text
    # include_reasoning false (vLLM's extra): the reasoning is parsed out and dropped.
    hidden = client.responses.create(**{**request, "extra_body": {**request["extra_body"], "include_reasoning": False}})
    assert all(item.type != "reasoning" for item in hidden.output)
