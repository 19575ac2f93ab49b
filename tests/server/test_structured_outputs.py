"""Structured outputs (issue 27 item 1) through the OpenAI API, on the small trained deepseek_v32 model
(models/deepseek_v32, a real byte-level BPE vocabulary): response_format json_schema / json_object,
vLLM's structured_outputs {json, regex, choice, grammar} and the older guided_* fields, on chat and
completions, streamed and not; logit_bias and allowed_token_ids; and the 400s for bad specs, naming the
field. Outputs are checked by jsonschema (when installed), re.fullmatch and membership."""
from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import openai
import pytest

from sparrow_server import API_KEY, MODEL_NAME

try:
    import jsonschema
except ImportError:  # checked by hand below
    jsonschema = None

REPO = Path(__file__).resolve().parents[2]
MODEL = REPO / "models" / "deepseek_v32"
HEADERS = {"Authorization": f"Bearer {API_KEY}"}
ASK = [{"role": "user", "content": "Describe a person as JSON."}]
PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0},
                         "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 2}},
          "required": ["name", "age"]}


@pytest.fixture(scope="module")
def structured_server(start_server):
    if not (MODEL / "config.json").exists():
        pytest.skip("the trained model models/deepseek_v32 is not present")
    return start_server("--api-key", API_KEY, model=MODEL)


def check_person(text: str) -> None:
    value = json.loads(text)
    if jsonschema:
        jsonschema.validate(value, PERSON)
    else:
        assert isinstance(value["name"], str) and isinstance(value["age"], int) and value["age"] >= 0
        assert set(value) <= {"name", "age", "pets"}


def test_number_bounds_hold(structured_server):
    """Bounded numbers and integers, exclusive bounds too: every complete answer lies within them."""
    schema = {"type": "object",
              "properties": {"score": {"type": "number", "minimum": -0.5, "exclusiveMaximum": 2.75},
                             "ratio": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
                             "count": {"type": "integer", "minimum": 3, "maximum": 40}},
              "required": ["score", "ratio", "count"]}
    client = structured_server.client(timeout=300)
    complete = 0
    for seed in range(6):
        choice = client.completions.create(model=MODEL_NAME, prompt="Scores as JSON: ", max_tokens=120, seed=seed,
                                           temperature=1.0, extra_body={"structured_outputs": {"json": schema}}).choices[0]
        if choice.finish_reason != "stop":
            continue
        complete += 1
        value = json.loads(choice.text)
        assert -0.5 <= value["score"] < 2.75 and 0 < value["ratio"] <= 1 and 3 <= value["count"] <= 40, value
        if jsonschema:
            jsonschema.validate(value, schema)
    assert complete > 0


def test_chat_json_schema(structured_server):
    response = structured_server.client().chat.completions.create(
        model=MODEL_NAME, messages=ASK, max_tokens=200, n=3, seed=1, temperature=0.8,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    whole = [c for c in response.choices if c.finish_reason == "stop"]
    assert whole, [c.message.content for c in response.choices]
    for choice in whole:
        check_person(choice.message.content)


def test_completion_structured_outputs_json_and_json_object(structured_server):
    client = structured_server.client()
    response = client.completions.create(model=MODEL_NAME, prompt="person = ", max_tokens=200, seed=3,
                                         extra_body={"structured_outputs": {"json": PERSON, "disable_any_whitespace": True}})
    choice = response.choices[0]
    if choice.finish_reason == "stop":
        check_person(choice.text)
        assert "\n" not in choice.text and ", " in choice.text or choice.text.count(",") == 0
    response = client.chat.completions.create(model=MODEL_NAME, messages=ASK, max_tokens=200, seed=4,
                                              response_format={"type": "json_object"})
    if response.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(response.choices[0].message.content), dict)


@pytest.mark.parametrize("field", ["structured_outputs", "guided_regex"])
def test_regex(structured_server, field):
    pattern = r"(\d{3})-[a-z]{2,5}(,[A-Z])?"
    body = {"structured_outputs": {"regex": pattern}} if field == "structured_outputs" else {"guided_regex": pattern}
    response = structured_server.client().completions.create(model=MODEL_NAME, prompt="code: ", max_tokens=30, n=4,
                                                              seed=5, temperature=1.0, extra_body=body)
    for choice in response.choices:
        assert choice.finish_reason == "stop" and re.fullmatch(pattern, choice.text), choice.text


def test_choice(structured_server):
    choices = ["sunny", "rainy", "cloudy with a chance of meatballs"]
    for body in ({"guided_choice": choices}, {"structured_outputs": {"choice": choices}}):
        response = structured_server.client().chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "Weather?"}], max_tokens=20, n=3, seed=6,
            temperature=1.0, extra_body=body)
        for choice in response.choices:
            assert choice.message.content in choices and choice.finish_reason == "stop", choice


def test_grammar(structured_server):
    grammar = r'''
root ::= "def " name "(" args? "):" [\n] "    return " name
name ::= [a-z_] [a-z0-9_]{0,8}
args ::= name (", " name){0,2}
'''
    response = structured_server.client().completions.create(
        model=MODEL_NAME, prompt="# a function\n", max_tokens=60, seed=7, temperature=0.7, n=2,
        extra_body={"guided_grammar": grammar, "guided_decoding_backend": "xgrammar"})
    for choice in response.choices:
        assert choice.finish_reason == "stop", choice.text
        assert re.fullmatch(r"def [a-z_][a-z0-9_]{0,8}\(([a-z_][a-z0-9_]{0,8}(, [a-z_][a-z0-9_]{0,8}){0,2})?\):\n"
                            r"    return [a-z_][a-z0-9_]{0,8}", choice.text), choice.text


def test_streaming_equals_the_whole_response(structured_server):
    client = structured_server.client()
    kwargs = dict(model=MODEL_NAME, messages=ASK, max_tokens=120, seed=8, temperature=0.9,
                  response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}})
    whole = client.chat.completions.create(**kwargs).choices[0]
    text, finish = "", None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    assert text == whole.message.content and finish == whole.finish_reason
    if finish == "stop":
        check_person(text)


def test_logit_bias_and_allowed_token_ids(structured_server):
    client = structured_server.client()
    response = client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=12, seed=9, temperature=1.0,
                                         extra_body={"allowed_token_ids": [300, 400, 500], "return_token_ids": True})
    assert set(response.choices[0].model_extra["token_ids"]) <= {300, 400, 500}
    response = client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=4, temperature=0,
                                         logit_bias={"777": 100}, extra_body={"return_token_ids": True})
    assert response.choices[0].model_extra["token_ids"] == [777] * 4


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format.json_schema.schema"),
    ({"structured_outputs": {"regex": "(?=a)b"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"grammar": "root ::= root \"a\""}}, "structured_outputs.grammar"),
    ({"guided_json": {"type": "object", "not": {}}}, "guided_json"),
    ({"guided_regex": "a{0,100000}"}, "guided_regex"),
    ({"guided_choice": []}, None),  # an empty list is "not given", as before
    ({"guided_regex": "a", "structured_outputs": {"choice": ["b"]}}, "guided_regex"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"five": 1}}, "logit_bias"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
])
def test_bad_specs_are_400s_naming_the_field(structured_server, body, param):
    response = httpx.post(structured_server.url + "/v1/chat/completions", headers=HEADERS, timeout=60,
                          json={"model": MODEL_NAME, "messages": ASK, "max_tokens": 4, **body})
    if param is None:
        assert response.status_code == 200, response.text
        return
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "BadRequestError" and error["code"] == 400, error
    assert error["param"] in (param, "structured_outputs.choice"), error


def test_ids_outside_the_vocabulary_are_400s(structured_server):
    for body in ({"allowed_token_ids": [10**6]}, {"logit_bias": {str(10**6): 1}}):
        response = httpx.post(structured_server.url + "/v1/completions", headers=HEADERS, timeout=60,
                              json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 4, **body})
        assert response.status_code == 400 and "vocabulary" in response.text, response.text
