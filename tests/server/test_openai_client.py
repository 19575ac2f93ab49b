"""The OpenAI-compatible API, driven by the official `openai` client (and httpx for what the client
cannot send): chat, streaming, completions with token ids, n > 1, logprobs, tools, reasoning,
tokenize / detokenize, metrics, and each error class. Greedy decoding (temperature 0) makes outputs
comparable across calls."""
from __future__ import annotations

import json
import threading
from pathlib import Path

import httpx
import openai
import pytest

from sparrow_server import API_KEY, MODEL_NAME, wait_until

REPO = Path(__file__).resolve().parents[2]
GREEDY = dict(temperature=0)
HEADERS = {"Authorization": f"Bearer {API_KEY}"}
HELLO = [{"role": "user", "content": "Hello, who are you?"}]
# Short: the test tokenizer spends a token per byte of the rendered tools, and the context is 256.
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
# A request that keeps the tiny test model busy for a second or so: 64 choices of 250 tokens.
LONG = dict(prompt=[3, 4, 5], max_tokens=250, n=64, temperature=0, extra_body={"ignore_eos": True})


def post(server, path, body, **kwargs):
    return httpx.post(server.url + path, json=body, headers=HEADERS, timeout=60, **kwargs)


def chat_prompt_ids(server, messages, **extra) -> list[int]:
    """The token ids the server renders `messages` to (/tokenize, chat form)."""
    response = post(server, "/tokenize", {"messages": messages, **extra})
    assert response.status_code == 200, response.text
    return response.json()["tokens"]


def raw_completion(server, prompt_ids, max_tokens, **extra) -> dict:
    """The greedy continuation of `prompt_ids` as text and ids, special tokens kept."""
    response = post(server, "/v1/completions", {"model": MODEL_NAME, "prompt": prompt_ids, "max_tokens": max_tokens,
                                                "temperature": 0, "return_token_ids": True,
                                                "skip_special_tokens": False, **extra})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


# --- discovery, health, tokenizer -------------------------------------------------------------------

def test_models_and_health(server):
    models = server.client().models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    assert models.data[0].model_extra["max_model_len"] == 256
    assert httpx.get(server.url + "/health").status_code == 200


def test_tokenize_detokenize_round_trip(server):
    text = "def f(x):\n    return x + 1"
    tokens = post(server, "/tokenize", {"prompt": text, "return_token_strs": True}).json()
    assert tokens["count"] == len(tokens["tokens"]) == len(text)  # one token per byte in the test tokenizer
    assert tokens["max_model_len"] == 256
    assert len(tokens["token_strs"]) == tokens["count"]
    assert post(server, "/detokenize", {"tokens": tokens["tokens"]}).json() == {"prompt": text}


# --- chat -------------------------------------------------------------------------------------------

def test_chat_completion(server):
    response = server.client().chat.completions.create(model=MODEL_NAME, messages=HELLO, max_tokens=8, **GREEDY)
    choice = response.choices[0]
    assert response.object == "chat.completion" and response.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    usage = response.usage
    assert usage.prompt_tokens == len(chat_prompt_ids(server, HELLO))
    assert 1 <= usage.completion_tokens <= 8 and usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    # The text is the greedy continuation of the rendered prompt.
    raw = raw_completion(server, chat_prompt_ids(server, HELLO), 8, skip_special_tokens=True)
    assert choice.message.content == raw["text"]


def test_chat_stream_equals_non_stream(server):
    client = server.client()
    full = client.chat.completions.create(model=MODEL_NAME, messages=HELLO, max_tokens=12, **GREEDY)
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=HELLO, max_tokens=12, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.model_dump() == full.usage.model_dump()
    finishes = [c.choices[0].finish_reason for c in chunks[:-1] if c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == full.choices[0].message.content


def test_chat_n_choices(server):
    client = server.client()
    greedy = client.chat.completions.create(model=MODEL_NAME, messages=HELLO, max_tokens=6, n=3, **GREEDY)
    assert [c.index for c in greedy.choices] == [0, 1, 2]
    assert len({c.message.content for c in greedy.choices}) == 1  # greedy: the same three times
    assert greedy.usage.completion_tokens % 3 == 0  # the three choices' tokens, the prompt counted once
    assert greedy.usage.prompt_tokens == len(chat_prompt_ids(server, HELLO))

    sampled = [client.chat.completions.create(model=MODEL_NAME, messages=HELLO, max_tokens=10, n=2, seed=7,
                                              temperature=1.0) for _ in range(2)]
    assert [c.message.content for c in sampled[0].choices] == [c.message.content for c in sampled[1].choices]

    stream = client.chat.completions.create(model=MODEL_NAME, messages=HELLO, max_tokens=6, n=3, stream=True,
                                            **GREEDY)
    texts, finishes = ["", "", ""], [0, 0, 0]
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            finishes[c.index] += c.finish_reason is not None
    assert texts == [c.message.content for c in greedy.choices] and finishes == [1, 1, 1]


def test_chat_logprobs(server):
    response = server.client().chat.completions.create(model=MODEL_NAME, messages=HELLO, max_tokens=5, logprobs=True,
                                                       top_logprobs=3, **GREEDY)
    entries = response.choices[0].logprobs.content
    assert len(entries) == response.usage.completion_tokens
    for entry in entries:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        # Greedy: the chosen token is the most likely one.
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob >= entry.top_logprobs[2].logprob
        assert isinstance(entry.bytes, list)


def test_chat_stop_and_length(server):
    client = server.client()
    response = client.chat.completions.create(model=MODEL_NAME, messages=HELLO, max_tokens=3, **GREEDY)
    assert response.choices[0].finish_reason in ("length", "stop") and response.usage.completion_tokens <= 3
    full = client.chat.completions.create(model=MODEL_NAME, messages=HELLO, max_tokens=12, **GREEDY)
    text = full.choices[0].message.content
    stop = next((ch for ch in text[2:] if ch.isprintable() and ch.strip()), None)
    if stop is None:
        pytest.skip("the greedy text has no printable character to stop at")
    stopped = client.chat.completions.create(model=MODEL_NAME, messages=HELLO, max_tokens=12, stop=[stop], **GREEDY)
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].message.content == text[:text.index(stop)]
    assert stopped.choices[0].model_extra["stop_reason"] == stop


# --- completions ------------------------------------------------------------------------------------

def test_completions_with_token_ids_match_transformers(server):
    """The fixture's greedy continuations, computed by transformers (tests/fixtures/*/greedy.json)."""
    fixture = REPO / "tests" / "fixtures" / "deepseek_v32"
    prompts = json.loads((fixture / "prompts.json").read_text())["prompts"]
    expected = json.loads((fixture / "greedy.json").read_text())["completions"]
    response = server.client().completions.create(
        model=MODEL_NAME, prompt=prompts, max_tokens=len(expected[0]), **GREEDY,
        extra_body={"ignore_eos": True, "return_token_ids": True})
    assert response.object == "text_completion" and response.id.startswith("cmpl-")
    assert [c.index for c in response.choices] == list(range(len(prompts)))
    assert [c.model_extra["token_ids"] for c in response.choices] == expected
    assert response.usage.prompt_tokens == sum(len(p) for p in prompts)
    assert response.usage.completion_tokens == sum(len(e) for e in expected)


def test_completions_text_prompts_stream_n_and_echo(server):
    client = server.client()
    prompts = ["def fibonacci(n):", "The capital of France is"]
    full = client.completions.create(model=MODEL_NAME, prompt=prompts, max_tokens=6, n=2, **GREEDY)
    assert [c.index for c in full.choices] == [0, 1, 2, 3]  # prompt * n + i
    assert full.choices[0].text == full.choices[1].text and full.choices[2].text == full.choices[3].text

    texts, finishes, usage = [""] * 4, [None] * 4, None
    for chunk in client.completions.create(model=MODEL_NAME, prompt=prompts, max_tokens=6, n=2, stream=True,
                                           stream_options={"include_usage": True}, **GREEDY):
        if not chunk.choices:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    assert texts == [c.text for c in full.choices]
    assert finishes == [c.finish_reason for c in full.choices]
    assert usage.model_dump() == full.usage.model_dump()

    echoed = client.completions.create(model=MODEL_NAME, prompt=prompts[0], max_tokens=6, echo=True, **GREEDY)
    assert echoed.choices[0].text == prompts[0] + full.choices[0].text


def test_completions_logprobs(server):
    response = server.client().completions.create(model=MODEL_NAME, prompt="abc", max_tokens=5, logprobs=2, **GREEDY)
    logprobs = response.choices[0].logprobs
    n = response.usage.completion_tokens
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == n
    assert all(len(top) <= 2 for top in logprobs.top_logprobs)
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(n)]
    assert logprobs.token_logprobs[0] == pytest.approx(max(logprobs.top_logprobs[0].values()))  # greedy


def test_prompt_logprobs_rank_every_prompt_token(server):
    """prompt_logprobs as vLLM gives them: per position the top k with ranks 1..k, and the prompt's own token
    with its integer rank over the whole vocabulary (1 + how many tokens are more likely) when not among them."""
    response = post(server, "/v1/completions", {"model": MODEL_NAME, "prompt": [5, 6, 7, 8, 9, 10], "max_tokens": 1,
                                                "temperature": 0, "prompt_logprobs": 1})
    assert response.status_code == 200, response.text
    positions = response.json()["choices"][0]["prompt_logprobs"]
    assert positions[0] is None and len(positions) == 6
    outside = 0
    for token, position in zip([5, 6, 7, 8, 9, 10][1:], positions[1:]):
        best = min(position.values(), key=lambda e: e["rank"])
        assert best["rank"] == 1
        own = position[str(token)]
        assert isinstance(own["rank"], int) and own["rank"] >= 1
        if own is not best:
            outside += 1
            assert own["rank"] > 1 and own["logprob"] <= best["logprob"]
    assert outside > 0  # the tiny model does not predict this prompt: some ranks come from the whole vocabulary


def test_completion_seeds_reproduce(server):
    client = server.client()
    runs = [client.completions.create(model=MODEL_NAME, prompt=[5, 6, 7], max_tokens=12, temperature=1.0, seed=42,
                                      extra_body={"return_token_ids": True}) for _ in range(2)]
    assert runs[0].choices[0].model_extra["token_ids"] == runs[1].choices[0].model_extra["token_ids"]


# --- tools and reasoning ----------------------------------------------------------------------------

def test_tools_are_accepted_and_parsed(parser_server):
    client = parser_server.client()
    for tool_choice in ("auto", "required", {"type": "function", "function": {"name": "get_weather"}}, "none"):
        response = client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER_TOOL],
            tool_choice=tool_choice, max_tokens=8, **GREEDY)
        message = response.choices[0].message
        for call in message.tool_calls or []:
            assert call.type == "function" and call.function.name == "get_weather"
            json.loads(call.function.arguments)
        if message.tool_calls and tool_choice in ("auto", "required"):
            assert response.choices[0].finish_reason == "tool_calls"
        for marker in ("<|tool_call", "<think>", "</think>"):
            assert marker not in (message.content or "")


def test_reasoning_split(parser_server):
    """kimi_k2 starts in reasoning (thinking on by default): with no </think> in the output, all of it is
    reasoning; with thinking off it is all content. Streamed deltas join to the non-streamed message."""
    client = parser_server.client()
    prompt = chat_prompt_ids(parser_server, HELLO)
    raw = raw_completion(parser_server, prompt, 10)
    if any(marker in raw["text"] for marker in ("<think>", "</think>", "<|tool_call")):
        pytest.skip("the greedy output happens to contain markup")

    thinking = client.chat.completions.create(model=MODEL_NAME, messages=HELLO, max_tokens=10, **GREEDY)
    message = thinking.choices[0].message
    assert message.content is None
    assert message.model_extra["reasoning"] == raw["text"].rstrip()
    assert thinking.usage.completion_tokens_details.reasoning_tokens == thinking.usage.completion_tokens

    reasoning, content = "", ""
    for chunk in client.chat.completions.create(model=MODEL_NAME, messages=HELLO, max_tokens=10, stream=True,
                                                **GREEDY):
        delta = chunk.choices[0].delta
        reasoning += (delta.model_extra or {}).get("reasoning") or ""
        content += delta.content or ""
    assert (reasoning, content) == (message.model_extra["reasoning"], "")

    plain = client.chat.completions.create(model=MODEL_NAME, messages=HELLO, max_tokens=10, **GREEDY,
                                           extra_body={"chat_template_kwargs": {"thinking": False}})
    assert plain.choices[0].message.content == raw["text"]
    assert plain.choices[0].message.model_extra["reasoning"] is None

    hidden = client.chat.completions.create(model=MODEL_NAME, messages=HELLO, max_tokens=10, **GREEDY,
                                            extra_body={"include_reasoning": False})
    assert hidden.choices[0].message.model_extra["reasoning"] is None


# --- metrics ----------------------------------------------------------------------------------------

def test_metrics(server):
    server.client().completions.create(model=MODEL_NAME, prompt=[1, 2, 3], max_tokens=4, **GREEDY)
    metrics = server.metrics()
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:prefix_cache_queries_total",
                 "vllm:prefix_cache_hits_total", "vllm:time_to_first_token_seconds_count",
                 "vllm:inter_token_latency_seconds_count", "vllm:e2e_request_latency_seconds_count",
                 "sparrow:decode_steps_total", "sparrow:prefill_step_seconds_total"):
        assert name in metrics, name
    assert metrics["vllm:generation_tokens_total"] >= 4
    # The engine loop's account: 4 tokens need one prefill step and 3 decode steps (the first token
    # comes from the prefill), and a step's forward part is part of the step.
    assert metrics["sparrow:prefill_steps_total"] >= 1 and metrics["sparrow:decode_steps_total"] >= 3
    assert 0 < metrics["sparrow:decode_forward_seconds_total"] <= metrics["sparrow:decode_step_seconds_total"]
    assert metrics["vllm:e2e_request_latency_seconds_count"] >= 1
    assert metrics['vllm:e2e_request_latency_seconds_bucket{le="+Inf"}'] == metrics["vllm:e2e_request_latency_seconds_count"]
    assert metrics['vllm:request_success_total{finished_reason="length"}'] >= 1
    # vLLM's request phases, request parameters and per-step token counts.
    for phase in ("queue", "prefill", "decode", "inference"):
        assert metrics[f"vllm:request_{phase}_time_seconds_count"] >= 1, phase
    assert metrics["vllm:request_inference_time_seconds_sum"] >= metrics["vllm:request_decode_time_seconds_sum"]
    assert metrics["vllm:request_params_max_tokens_count"] >= 1 and metrics["vllm:request_params_n_count"] >= 1
    assert metrics["vllm:request_max_num_generation_tokens_count"] >= 1
    # The request above: a prefill step of 3 tokens and 3 decode steps of 1 (other tests add more).
    assert metrics['vllm:iteration_tokens_total_bucket{le="1"}'] >= 3
    assert metrics['vllm:iteration_tokens_total_bucket{le="+Inf"}'] == metrics["vllm:iteration_tokens_total_count"] >= 4
    assert any(key.startswith("vllm:cache_config_info{") and 'block_size="64"' in key for key in metrics)


def test_prefix_cache_hits_are_counted(server):
    prompt = list(range(10, 10 + 150))  # more than two 64-token blocks
    client = server.client()
    before = server.metrics()["vllm:prefix_cache_hits_total"]
    first = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=4, **GREEDY)
    second = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=4, **GREEDY)
    assert second.choices[0].text == first.choices[0].text
    assert server.metrics()["vllm:prefix_cache_hits_total"] - before >= 128


# --- chat echo ----------------------------------------------------------------------------------------

CONTINUE = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "I am a"}]
CONTINUE_ARGS = dict(add_generation_prompt=False, continue_final_message=True)


def test_chat_echo_puts_the_final_assistant_message_first(server):
    client = server.client()
    plain = client.chat.completions.create(model=MODEL_NAME, messages=CONTINUE, max_tokens=6, n=2,
                                           extra_body=CONTINUE_ARGS, **GREEDY)
    echoed = client.chat.completions.create(model=MODEL_NAME, messages=CONTINUE, max_tokens=6, n=2,
                                            extra_body={**CONTINUE_ARGS, "echo": True}, **GREEDY)
    assert [c.message.content for c in echoed.choices] == ["I am a" + c.message.content for c in plain.choices]
    assert echoed.usage == plain.usage  # the echoed text is not counted as generated

    # Streamed: the role chunk, then the echoed text as the first content delta of each choice.
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=CONTINUE, max_tokens=6, n=2, stream=True,
                                                 extra_body={**CONTINUE_ARGS, "echo": True}, **GREEDY))
    for index in range(2):
        deltas = [c.choices[0].delta for c in chunks if c.choices and c.choices[0].index == index]
        assert deltas[0].role == "assistant" and deltas[0].content == ""
        assert deltas[1].content == "I am a"
        assert "".join(d.content or "" for d in deltas) == echoed.choices[index].message.content


def test_chat_echo_of_another_role_is_nothing(server):
    # The last message is not the response's role (assistant): nothing is echoed, as in vLLM. (Content
    # parts joined by newlines: ServerRequests.ChatEcho; the test template renders no parts of a final
    # assistant message it continues.)
    client = server.client()
    plain = client.chat.completions.create(model=MODEL_NAME, messages=HELLO, max_tokens=3, **GREEDY)
    not_echoed = client.chat.completions.create(model=MODEL_NAME, messages=HELLO, max_tokens=3,
                                                extra_body={"echo": True}, **GREEDY)
    assert not_echoed.choices[0].message.content == plain.choices[0].message.content


# --- errors -----------------------------------------------------------------------------------------

def error_of(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["code"] == response.status_code
    return body["error"]


@pytest.mark.parametrize("body, param", [
    ({"messages": HELLO, "max_tokens": -1}, "max_tokens"),
    ({"messages": HELLO, "temperature": "hot"}, "temperature"),
    ({"messages": HELLO, "tools": []}, "tools"),
    ({"messages": HELLO, "tool_choice": "auto"}, "tool_choice"),
    ({"messages": HELLO, "stream_options": {"include_usage": True}}, "stream_options"),
    ({"messages": HELLO, "top_logprobs": 3}, "top_logprobs"),
    ({"messages": HELLO, "n": 0}, "n"),
    ({"messages": HELLO, "echo": "yes"}, "echo"),
    ({"messages": "hello"}, "messages"),
    ({"messages": [{"role": "user", "content": "x" * 400}]}, "messages"),  # longer than max_model_len
    ({"messages": HELLO, "max_tokens": 1000}, "max_tokens"),                 # prompt + max_tokens too long
])
def test_bad_chat_requests_are_400(server, body, param):
    response = post(server, "/v1/chat/completions", {"model": MODEL_NAME, **body})
    assert response.status_code == 400
    error = error_of(response)
    assert error["type"] == "BadRequestError" and error["param"] == param, error


def test_client_raises_the_matching_errors(server):
    client = server.client()
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL_NAME, messages=HELLO, max_tokens=-5)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model=MODEL_NAME, prompt="y" * 300, max_tokens=4)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL_NAME, prompt=[300], max_tokens=4)  # outside the vocabulary
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=HELLO, max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        server.client(api_key="wrong").chat.completions.create(model=MODEL_NAME, messages=HELLO, max_tokens=2)
    with pytest.raises(openai.BadRequestError):  # "required" needs a tool parser: the call is forced in its format
        client.chat.completions.create(model=MODEL_NAME, messages=HELLO, tools=[WEATHER_TOOL], tool_choice="required",
                                       max_tokens=2)


def test_http_level_errors(server):
    malformed = httpx.post(server.url + "/v1/chat/completions", content=b"{not json", timeout=10,
                           headers={**HEADERS, "Content-Type": "application/json"})
    assert malformed.status_code == 400 and error_of(malformed)["type"] == "BadRequestError"
    not_json = httpx.post(server.url + "/v1/completions", content=b"prompt=x", headers=HEADERS, timeout=10)
    assert not_json.status_code == 400
    unknown = httpx.get(server.url + "/v1/nothing-here", headers=HEADERS, timeout=10)
    assert unknown.status_code == 404 and error_of(unknown)["type"] == "NotFoundError"
    no_key = httpx.post(server.url + "/v1/completions", json={"prompt": "x"}, timeout=10)
    assert no_key.status_code == 401 and error_of(no_key)["type"] == "AuthenticationError"
    assert httpx.get(server.url + "/metrics", timeout=10).status_code == 200  # no key needed
    too_large = httpx.post(server.url + "/v1/completions", headers={**HEADERS, "Content-Type": "application/json"},
                           content=b'{"prompt": "' + b"x" * (33 << 20) + b'"}', timeout=60)
    assert too_large.status_code == 413 and error_of(too_large)["type"] == "RequestTooLargeError"


def test_full_queue_is_503(start_server):
    # One sequence runs and none may wait: a second request is refused while the first runs.
    busy = start_server("--max-num-seqs", "1", "--max-queued-requests", "0")
    client = busy.client()
    stream = client.completions.create(model=MODEL_NAME, stream=True, **LONG)
    next(iter(stream))  # the first request holds the only place
    with pytest.raises(openai.InternalServerError) as refused:
        client.completions.create(model=MODEL_NAME, prompt=[1, 2], max_tokens=2)
    assert refused.value.status_code == 503 and refused.value.response.headers["retry-after"] == "1"
    stream.close()
    # Once the first is gone (aborted), requests are served again.
    assert wait_until(lambda: busy.metrics()["vllm:num_requests_running"] == 0)
    assert wait_until(lambda: _served(client), timeout_s=10)


def _served(client) -> bool:
    try:
        client.completions.create(model=MODEL_NAME, prompt=[1, 2], max_tokens=2)
        return True
    except openai.InternalServerError:
        return False


# --- disconnects and shutdown -----------------------------------------------------------------------

def test_client_disconnect_aborts_the_request(start_server):
    server = start_server()
    client = server.client()
    aborted = 'vllm:request_success_total{finished_reason="abort"}'

    stream = client.completions.create(model=MODEL_NAME, stream=True, **LONG)
    next(iter(stream))
    assert server.metrics()["vllm:num_requests_running"] >= 1
    stream.close()
    settled = lambda: (m := server.metrics())["vllm:num_requests_running"] == 0 and m["sparrow:kv_cache_blocks_used"] == 0
    assert wait_until(settled, timeout_s=15), server.metrics()
    after_stream = server.metrics()[aborted]
    assert after_stream >= 1

    # A non-streaming client that gives up: the read kept open on its connection notices it.
    with pytest.raises(openai.APITimeoutError):
        server.client(timeout=0.3).completions.create(model=MODEL_NAME, **LONG)
    assert wait_until(settled, timeout_s=15), server.metrics()
    assert server.metrics()[aborted] > after_stream


def stream_in_background(client, results: dict, **request) -> threading.Thread:
    """Streams a completion on a thread; results["finish"] gets each choice's finish_reason."""
    def run():
        finish = {}
        for chunk in client.completions.create(model=MODEL_NAME, stream=True, **request):
            for c in chunk.choices:
                if c.finish_reason:
                    finish[c.index] = c.finish_reason
        results["finish"] = finish

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_sigterm_drains_running_requests(start_server):
    server = start_server("--shutdown-timeout", "60")
    results = {}
    worker = stream_in_background(server.client(), results, **LONG)
    assert wait_until(lambda: server.metrics()["vllm:num_requests_running"] >= 1)
    assert server.stop() == 0
    worker.join(30)
    assert list(results["finish"].values()) == ["length"] * 64  # they finished instead of being cut off


def test_sigterm_aborts_what_outlasts_the_timeout(start_server):
    server = start_server("--shutdown-timeout", "0")
    results = {}
    worker = stream_in_background(server.client(), results, **LONG)
    assert wait_until(lambda: server.metrics()["vllm:num_requests_running"] >= 1)
    assert server.stop() == 0
    worker.join(30)
    assert "abort" in results["finish"].values() and len(results["finish"]) == 64
