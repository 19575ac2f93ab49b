"""Hostile request bodies against a real `sparrow serve` (no --api-key, the default): JSON nested 30,000
levels deep in every place a request carries free-form JSON, templates driven into deep recursion, huge
ranges and huge output, and the content forms vLLM refuses. Each gets a 400 naming the limit or the field
(docs/server.md, "Limits"), and the server answers a normal request right after, within 2 s."""
from __future__ import annotations

import time

import httpx
import pytest

from sparrow_server import MODEL_NAME

DEPTH = 30000  # the reproduction: ~60 KB of brackets
HELLO = [{"role": "user", "content": "Hello"}]

# A --chat-template (operator input) that lets a request steer the renderer: `depth` levels of macro
# recursion, range(`count`), `copies` copies of the first message, `rows` x `cols` loop iterations,
# and `gather`: the messages concatenated one by one, quadratic in their number (as Kimi K3's template
# gathers runs of tool messages).
STEERABLE_TEMPLATE = (
    "{%- macro down(n) %}{% if n > 0 %}{{ down(n - 1) }}{% endif %}{% endmacro -%}"
    "{%- if depth is defined %}{{ down(depth) }}{% endif -%}"
    "{%- if count is defined %}{% for i in range(count) %}{% endfor %}{% endif -%}"
    "{%- if copies is defined %}{% for i in range(copies) %}{{ messages[0].content }}{% endfor %}{% endif -%}"
    "{%- if rows is defined %}{% set js = range(cols) %}{% for i in range(rows) %}{% for j in js %}{% endfor %}{% endfor %}"
    "{% endif -%}"
    "{%- if gather is defined %}{% set ns = namespace(l=[]) %}{% for m in messages %}{% set ns.l = ns.l + [m] %}"
    "{% endfor %}{% endif -%}"
    "{%- for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}<|assistant|>")


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.fixture(scope="module")
def plain_server(start_server):
    return start_server()


@pytest.fixture(scope="module")
def steerable_server(start_server, tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "steerable.jinja"
    template.write_text(STEERABLE_TEMPLATE)
    return start_server("--chat-template", str(template))


def post_raw(server, path: str, body: str) -> httpx.Response:
    return httpx.post(server.url + path, content=body.encode(), headers={"Content-Type": "application/json"},
                      timeout=60)


def error_of(response: httpx.Response) -> dict:
    assert response.status_code == 400, (response.status_code, response.text[:500])
    return response.json()["error"]


def assert_still_serving(server):
    """A normal chat completion right after succeeds, within 2 s."""
    start = time.monotonic()
    response = httpx.post(server.url + "/v1/chat/completions", timeout=10,
                          json={"model": MODEL_NAME, "messages": HELLO, "max_tokens": 2, "temperature": 0})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["role"] == "assistant"
    assert time.monotonic() - start < 2


# Each body holds `nested(DEPTH)` at one place a request carries arbitrary JSON.
DEEP_BODIES = {
    "messages[].content": ("/v1/chat/completions", '{"messages": [{"role": "user", "content": %s}]}'),
    "an extra message key": ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x", "extra": %s}]}'),
    "tools[].function.parameters": (
        "/v1/chat/completions",
        '{"messages": [{"role": "user", "content": "x"}], '
        '"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "x": %s}}}]}'),
    "chat_template_kwargs": ("/v1/chat/completions",
                             '{"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"x": %s}}'),
    "documents": ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x"}], "documents": [%s]}'),
    "/tokenize messages": ("/tokenize", '{"messages": [{"role": "user", "content": %s}]}'),
    "/tokenize prompt": ("/tokenize", '{"prompt": %s}'),
    "/detokenize tokens": ("/detokenize", '{"tokens": %s}'),
    "/v1/completions prompt": ("/v1/completions", '{"prompt": %s}'),
}


@pytest.mark.parametrize("where", sorted(DEEP_BODIES))
def test_json_nested_30000_deep_is_400(plain_server, where):
    path, body = DEEP_BODIES[where]
    error = error_of(post_raw(plain_server, path, body % nested(DEPTH)))
    assert "more than 128 levels deep" in error["message"], error
    assert_still_serving(plain_server)


def test_tool_call_arguments_text_nested_deep_is_400(plain_server):
    arguments = '{"a": %s}' % nested(DEPTH)
    body = {"messages": [{"role": "user", "content": "x"},
                         {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                               "function": {"name": "f", "arguments": arguments}}]},
                         {"role": "tool", "tool_call_id": "c", "content": "ok"}]}
    response = httpx.post(plain_server.url + "/v1/chat/completions", json=body, timeout=60)
    assert "128 levels" in error_of(response)["message"]
    assert_still_serving(plain_server)


def test_json_as_deep_as_allowed_is_served(plain_server):
    # 128 levels in all: the body, messages, the message and 125 in its extra key.
    body = '{"messages": [{"role": "user", "content": "x", "extra": %s}], "max_tokens": 1}' % nested(125)
    assert post_raw(plain_server, "/v1/chat/completions", body).status_code == 200
    body = '{"messages": [{"role": "user", "content": "x", "extra": %s}], "max_tokens": 1}' % nested(126)
    assert post_raw(plain_server, "/v1/chat/completions", body).status_code == 400


def test_an_object_of_200000_keys_is_served_quickly(plain_server):
    kwargs = {f"k{i}": i for i in range(200000)}  # ~3.5 MB; a quadratic dict would take minutes
    start = time.monotonic()
    response = httpx.post(plain_server.url + "/v1/chat/completions", timeout=120,
                          json={"messages": HELLO, "max_tokens": 1, "chat_template_kwargs": kwargs})
    assert response.status_code == 200, response.text
    assert time.monotonic() - start < 30
    assert_still_serving(plain_server)


@pytest.mark.parametrize("kwargs, limit", [
    ({"depth": 100000}, "maximum recursion depth exceeded"),
    ({"count": 10 ** 12}, "MAX_RANGE (100000)"),
    ({"copies": 100}, "exceeds the template limit of 67108864 bytes"),  # 100 copies of a 1 MB message
    ({"rows": 100000, "cols": 100000}, "more than 1000000 loop iterations"),
])
def test_templates_driven_past_their_limits_are_400(steerable_server, kwargs, limit):
    messages = [{"role": "user", "content": "x" * (1 << 20) if "copies" in kwargs else "hi"}]
    response = httpx.post(steerable_server.url + "/v1/chat/completions", timeout=120,
                          json={"messages": messages, "max_tokens": 1, "chat_template_kwargs": kwargs})
    error = error_of(response)
    assert limit in error["message"] and error["param"] == "messages", error
    assert_still_serving(steerable_server)


def test_a_render_quadratic_in_the_request_stops_in_time(steerable_server):
    messages = [{"role": "tool", "content": ""}] * 300000  # 4.5e10 list items to copy: hours
    start = time.monotonic()
    response = httpx.post(steerable_server.url + "/v1/chat/completions", timeout=120,
                          json={"messages": messages, "max_tokens": 1, "chat_template_kwargs": {"gather": True}})
    assert "the render took more than 10 seconds" in error_of(response)["message"]
    assert time.monotonic() - start < 60
    assert_still_serving(steerable_server)


def test_recursion_within_the_limit_renders(steerable_server):
    response = httpx.post(steerable_server.url + "/v1/chat/completions", timeout=60,
                          json={"messages": HELLO, "max_tokens": 1, "chat_template_kwargs": {"depth": 200}})
    assert response.status_code == 200, response.text


# --- the smaller items: numbers beyond float32, content forms ---

@pytest.mark.parametrize("field", ["temperature", "repetition_penalty"])
def test_float_beyond_float32_is_400_naming_the_field(plain_server, field):
    body = '{"messages": [{"role": "user", "content": "x"}], "%s": 1e308}' % field
    error = error_of(post_raw(plain_server, "/v1/chat/completions", body))
    assert error["param"] == field and "1e+308" in error["message"], error


@pytest.mark.parametrize("content, param", [
    (42, "messages[0].content"),
    ({"text": "hi"}, "messages[0].content"),
    (None, "messages[0].content"),
    ([["hi"]], "messages[0].content[0]"),
    ([{"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}], "messages[0].content[0].image_url.url"),
    ([{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}], "messages[0].content[0].type"),
])
def test_content_forms_vllm_refuses_are_400(plain_server, content, param):
    response = httpx.post(plain_server.url + "/v1/chat/completions", timeout=60,
                          json={"messages": [{"role": "user", "content": content}], "max_tokens": 1})
    error = error_of(response)
    assert error["param"] == param, error
    if param.endswith(".type"):
        assert "not supported" in error["message"], error
    if param.endswith(".url"):  # this model has no vision tower (tests/server/test_images.py serves one that has)
        assert "takes no images" in error["message"], error


def test_content_forms_vllm_accepts_are_served(plain_server):
    for messages in ([{"role": "user", "content": [{"type": "text", "text": "Hello"}]}],
                     [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None},
                      {"role": "user", "content": "Hello"}]):
        response = httpx.post(plain_server.url + "/v1/chat/completions", timeout=60,
                              json={"messages": messages, "max_tokens": 1})
        assert response.status_code == 200, response.text
