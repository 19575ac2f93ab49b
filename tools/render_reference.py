#!/usr/bin/env python3
"""Expected chat-template renders for tests/template_test.cpp, made with Python jinja2 exactly as
vLLM's chat endpoint renders a request through transformers' apply_chat_template (transformers
5.17, utils/chat_template_utils.py).

Inputs (tests/data/templates/):
  *.jinja              the real templates, byte-exact copies
  models.json          per model: its template file and tokenizer_config.json entries (special tokens)
  conversations.json   chat requests [{name, request}], each rendered with every model's template
  snippets.json        small templates, one interpreter feature each: [{name, template, request?,
                       sparrow_error? (sparrow's wording where it differs from jinja2's on purpose)}]
Outputs:
  expected/<model>.json   {conversation name: {"prompt": text} or {"error": message}}
  snippets.json           the same file, with "prompt" / "error" filled in

    python3 tools/render_reference.py            # rewrite the expectations
    python3 tools/render_reference.py --check    # compare with what is committed; exit 1 on a difference

The render below rebuilds transformers' environment from jinja2 alone (so that the live test,
tests/template_live_test.py, needs only jinja2); when transformers is installed, every render is
also made with transformers' own render_jinja_template and must agree byte for byte.
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

DATA = Path(__file__).resolve().parent.parent / "tests" / "data" / "templates"
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # transformers' marker for continue_final_message


class _GenerationTag(jinja2.ext.Extension):
    """transformers' AssistantTracker as rendering sees it: {% generation %} renders its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _compile(source: str) -> jinja2.Template:
    """transformers' _cached_compile_jinja_template."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
    return env.from_string(source)


def _render_jinja_template(source, messages, tools, documents, add_generation_prompt, continue_final_message,
                           **kwargs) -> str:
    """transformers' render_jinja_template for one conversation (no assistant-token mask)."""
    messages = copy.deepcopy(messages)
    final_text = None
    if continue_final_message:
        final = messages[-1].get("content")
        if final is None:
            raise ValueError('continue_final_message is set but the final message has no "content" to continue!')
        if "content" not in source:
            raise ValueError('continue_final_message is set to "content" but this is not an accepted field in the '
                             "chat_template")
        if isinstance(final, (list, tuple)):
            for block in reversed(final):
                if "text" in block:
                    final_text = block["text"]
                    block["text"] = block["text"] + CONTINUE_TAG
                    break
            else:
                raise ValueError("continue_final_message is set but we could not find any text to continue in the "
                                 "final message!")
        else:
            final_text = final
            messages[-1]["content"] = final + CONTINUE_TAG
    rendered = _compile(source).render(messages=messages, tools=tools, documents=documents,
                                       add_generation_prompt=add_generation_prompt, **kwargs)
    if continue_final_message:
        if final_text.strip() not in rendered or CONTINUE_TAG.strip() not in rendered:
            raise ValueError("continue_final_message is set but the final message does not appear in the chat after "
                             "applying the chat template!")
        at = rendered.rindex(CONTINUE_TAG.strip())
        rendered = rendered[:at] if rendered[at:at + len(CONTINUE_TAG)] == CONTINUE_TAG else rendered[:at].rstrip()
    return rendered


def special_tokens(tokenizer_config: dict) -> dict:
    """transformers' special_tokens_map: every *_token entry (and extra_special_tokens entry) that is a
    string or an AddedToken {"content": ...}."""
    def text(value):
        if isinstance(value, dict):
            value = value.get("content")
        return value if isinstance(value, str) else None

    tokens = {key: text(value) for key, value in tokenizer_config.items() if key.endswith("_token") and text(value)}
    extra = tokenizer_config.get("extra_special_tokens")
    if isinstance(extra, dict):
        tokens.update({key: text(value) for key, value in extra.items() if text(value)})
    return tokens


def parse_tool_call_arguments(messages: list) -> None:
    """vLLM's _postprocess_messages: JSON-string tool-call arguments become objects."""
    for message in messages:
        if message.get("role") == "assistant" and isinstance(message.get("tool_calls"), list):
            for call in message["tool_calls"]:
                arguments = call["function"].get("arguments")
                if arguments:
                    if not isinstance(arguments, (dict, list)):
                        call["function"]["arguments"] = json.loads(arguments)
                else:
                    call["function"]["arguments"] = {}


def render_request(source: str, tokenizer_config: dict, request: dict, use_transformers: bool = False) -> str:
    """The prompt vLLM renders for an OpenAI chat request with this template and tokenizer config."""
    request = copy.deepcopy(request)
    messages = request["messages"]
    parse_tool_call_arguments(messages)
    add_generation_prompt = request.get("add_generation_prompt")
    params = {
        "tools": request.get("tools"),
        "documents": request.get("documents"),
        "add_generation_prompt": True if add_generation_prompt is None else add_generation_prompt,
    }
    params.update(request.get("chat_template_kwargs") or {})  # vLLM: chat_template_kwargs override the rest
    continue_final_message = bool(request.get("continue_final_message"))
    if continue_final_message and params["add_generation_prompt"]:
        raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
    tools, documents = params.pop("tools"), params.pop("documents")
    add_generation_prompt = params.pop("add_generation_prompt")
    kwargs = {**special_tokens(tokenizer_config), **params}
    if use_transformers:
        from transformers.utils.chat_template_utils import render_jinja_template

        rendered, _ = render_jinja_template(conversations=[messages], tools=tools, documents=documents,
                                            chat_template=source, continue_final_message=continue_final_message,
                                            add_generation_prompt=add_generation_prompt, **kwargs)
        return rendered[0]
    return _render_jinja_template(source, messages, tools, documents, add_generation_prompt, continue_final_message,
                                  **kwargs)


def outcome(source: str, tokenizer_config: dict, request: dict, use_transformers: bool = False) -> dict:
    """{"prompt": text} or {"error": message}."""
    try:
        return {"prompt": render_request(source, tokenizer_config, request, use_transformers)}
    except Exception as e:  # template errors (raise_exception, undefined, ...) are expected outcomes too
        return {"error": str(e)}


def load_models() -> dict:
    """{model name: (template source, tokenizer_config)}; templates are read as bytes-exact text."""
    models = json.loads((DATA / "models.json").read_text(encoding="utf-8"))
    return {name: ((DATA / m["template"]).read_bytes().decode("utf-8"), m["tokenizer_config"])
            for name, m in models.items()}


def snippet_request(snippet: dict) -> dict:
    return snippet.get("request", {"messages": []})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="compare with the committed files instead of writing")
    args = parser.parse_args()
    try:
        import transformers  # noqa: F401

        have_transformers = True
    except ImportError:
        have_transformers = False
        print("transformers is not installed: renders are not cross-checked against it", file=sys.stderr)

    def reference(source, tokenizer_config, request, what):
        result = outcome(source, tokenizer_config, request)
        if have_transformers:
            theirs = outcome(source, tokenizer_config, request, use_transformers=True)
            if theirs.get("prompt") != result.get("prompt") or ("error" in theirs) != ("error" in result):
                raise SystemExit(f"{what}: jinja2 environment and transformers disagree:\n{result}\n{theirs}")
        return result

    differences = 0
    conversations = json.loads((DATA / "conversations.json").read_text(encoding="utf-8"))
    for name, (source, tokenizer_config) in load_models().items():
        expected = {c["name"]: reference(source, tokenizer_config, c["request"], f"{name}/{c['name']}")
                    for c in conversations}
        path = DATA / "expected" / f"{name}.json"
        text = json.dumps(expected, indent=1, ensure_ascii=False) + "\n"
        if args.check:
            if not path.exists() or path.read_text(encoding="utf-8") != text:
                print(f"{path} is out of date", file=sys.stderr)
                differences += 1
        else:
            path.parent.mkdir(exist_ok=True)
            path.write_text(text, encoding="utf-8")
        errors = sum("error" in r for r in expected.values())
        print(f"{name}: {len(expected)} conversations ({errors} end in a template error)")

    snippets_path = DATA / "snippets.json"
    snippets = json.loads(snippets_path.read_text(encoding="utf-8"))
    for s in snippets:
        s.pop("prompt", None)
        s.pop("error", None)
        s.update(reference(s["template"], {}, snippet_request(s), f"snippet {s['name']}"))
    text = json.dumps(snippets, indent=1, ensure_ascii=False) + "\n"
    if args.check:
        if snippets_path.read_text(encoding="utf-8") != text:
            print(f"{snippets_path} is out of date", file=sys.stderr)
            differences += 1
    else:
        snippets_path.write_text(text, encoding="utf-8")
    print(f"snippets: {len(snippets)}")
    return 1 if differences else 0


if __name__ == "__main__":
    sys.exit(main())
