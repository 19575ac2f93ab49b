"""Tool calling and reasoning end to end, on the small trained models of issue 3 (models/<family>/,
tools/train_small_models.py), which learned to think and call the tools of tools/chat_corpus.py in
their family's own syntax. Per model: the server runs with the family's parsers; for questions whose
training answer was a tool call, the streamed deltas (reasoning, content, tool-call id / name /
argument fragments) must join to exactly the non-streamed message, no markup may reach the content,
and the model must call a tool at least once, with finish_reason "tool_calls".

Skipped when no trained model is present. SPARROW_MODELS_DIR overrides the models/ folder."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from sparrow_server import MODEL_NAME

REPO = Path(__file__).resolve().parents[2]
MODELS = Path(os.environ.get("SPARROW_MODELS_DIR", REPO / "models"))
sys.path.insert(0, str(REPO / "tools"))

# config.json model_type -> the --tool-call-parser / --reasoning-parser of its chat format.
PARSERS = {"kimi_k3": "kimi_k3", "kimi_linear": "kimi_k2", "deepseek_v32": "deepseek_v32",
           "minimax_m3": "minimax_m3", "minimax_m3_vl": "minimax_m3", "minimax_m3_vl_text": "minimax_m3"}
MARKUP = ("<|", "|>", "<think>", "</think>", "<minimax:", "<invoke", "]<]", "<｜", "｜>")


def trained_models() -> list[Path]:
    if not MODELS.is_dir():
        return []
    return sorted(p for p in MODELS.iterdir() if (p / "config.json").exists() and (p / "tokenizer_config.json").exists())


def tool_questions(count: int = 6):
    """Conversations cut before an assistant turn that called a tool in the training data."""
    from chat_corpus import demo_conversation, make_conversations
    questions = []
    for messages, tools in [demo_conversation(), *make_conversations(seed=2024, count=200)]:
        first_answer = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
        if messages[first_answer].get("tool_calls"):
            questions.append((messages[:first_answer], tools))
        if len(questions) == count:
            break
    return questions


def join_stream(stream) -> dict:
    message = {"reasoning": "", "content": "", "tool_calls": {}}
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            message["reasoning"] += (delta.model_extra or {}).get("reasoning") or ""
            message["content"] += delta.content or ""
            for call in delta.tool_calls or []:
                entry = message["tool_calls"].setdefault(call.index, {"id": None, "name": None, "arguments": ""})
                if call.id is not None:
                    assert entry["id"] is None, "a tool call announced twice"
                    entry["id"], entry["name"] = call.id, call.function.name
                else:
                    assert call.function.name is None, "a name outside the call's first delta"
                entry["arguments"] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    message["tool_calls"] = [message["tool_calls"][i] for i in sorted(message["tool_calls"])]
    return {"message": message, "finish": finish}


@pytest.mark.parametrize("model", trained_models() or [None], ids=lambda p: p.name if p else "none")
def test_streamed_tool_calls_and_reasoning(start_server, model):
    if model is None:
        pytest.skip(f"no trained model in {MODELS} (issue 3)")
    parser = PARSERS[json.loads((model / "config.json").read_text())["model_type"]]
    server = start_server("--tool-call-parser", parser, "--reasoning-parser", parser, "--enable-auto-tool-choice",
                          "--kv-cache-memory", "512MiB", model=model)
    client = server.client(timeout=300)
    calls = 0
    for messages, tools in tool_questions():
        request = dict(model=MODEL_NAME, messages=messages, tools=tools, max_tokens=160, temperature=0)
        full = client.chat.completions.create(**request)
        streamed = join_stream(client.chat.completions.create(**request, stream=True))
        message = full.choices[0].message
        expected = {"reasoning": message.model_extra.get("reasoning") or "", "content": message.content or "",
                    "tool_calls": [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                                   for c in message.tool_calls or []]}
        # Formats without call ids in their markup get random ones, different in the two requests.
        streamed_ids = [c.pop("id") for c in streamed["message"]["tool_calls"]]
        expected_ids = [c.pop("id") for c in expected["tool_calls"]]
        assert streamed["message"] == expected
        for ids in (streamed_ids, expected_ids):
            assert all(isinstance(i, str) and i for i in ids) and len(set(ids)) == len(ids)
        assert streamed["finish"] == full.choices[0].finish_reason
        assert not any(marker in expected["content"] for marker in MARKUP), expected["content"]
        for call in expected["tool_calls"]:
            assert call["name"] in {t["function"]["name"] for t in tools}
            assert isinstance(json.loads(call["arguments"]), dict)
        if expected["tool_calls"]:
            calls += 1
            assert full.choices[0].finish_reason == "tool_calls"
    assert calls >= 1, "the trained model called no tool"
