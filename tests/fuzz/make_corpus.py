#!/usr/bin/env python3
"""Writes the fuzz targets' seed corpora (tests/fuzz/corpus/<target>/) and dictionaries (tests/fuzz/dict/)
from the repository's test data: request bodies, chat templates and conversations, tokenizer texts, fixture
configs, parser vectors, and small safetensors files built here.

    python3 tests/fuzz/make_corpus.py   # then commit; inputs the fuzzers found are added by hand (README.md)

Seeds are named seed-<sha1>; inputs kept from fuzzing runs (regressions) are named after what they found
and are left alone.
"""
import hashlib
import json
import pathlib
import random
import struct

ROOT = pathlib.Path(__file__).resolve().parents[2]
FUZZ = ROOT / "tests" / "fuzz"
PARSERS = ["kimi_k3", "kimi_k2", "minimax_m3", "minimax_m2", "deepseek_v32"]
# The order the targets' first input byte picks from (fuzz_chat_template.cpp, fuzz_tokenizer_hf.cpp).
TEMPLATE_COUNT = 6
HF_TOKENIZER_COUNT = 5


def load(path):
    return json.loads((ROOT / path).read_text(encoding="utf-8"))


def write_corpus(target, seeds):
    folder = FUZZ / "corpus" / target
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("seed-*"):
        old.unlink()
    for seed in seeds:
        data = seed if isinstance(seed, bytes) else seed.encode("utf-8")
        (folder / ("seed-" + hashlib.sha1(data).hexdigest()[:16])).write_bytes(data)


def dict_entry(token):
    data = token if isinstance(token, bytes) else token.encode("utf-8")
    text = "".join(chr(b) if 0x20 <= b < 0x7F and b not in (0x22, 0x5C) else "\\x%02X" % b for b in data)
    return '"' + text + '"'


def write_dict(name, about, tokens):
    unique = []
    for t in tokens:
        if t and t not in unique:
            unique.append(t)
    lines = ["# " + about, "# Written by tests/fuzz/make_corpus.py."] + [dict_entry(t) for t in unique]
    (FUZZ / "dict").mkdir(exist_ok=True)
    (FUZZ / "dict" / (name + ".dict")).write_text("\n".join(lines) + "\n", encoding="utf-8")


def compact(value):
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


# ---- request bodies ----

USER = [{"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]


def chat_bodies():
    conversations = [c["request"] for c in load("tests/data/templates/conversations.json")]
    bodies = conversations + [load("docs/examples/chat_with_tools.json"), load("docs/examples/chat_with_tool_result.json")]
    extra = [
        {"model": "m", "max_tokens": 5, "max_completion_tokens": 7, "temperature": 0, "n": 2, "stop": "x", "seed": 3,
         "logprobs": True, "top_logprobs": 2},
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
        {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False},
        {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
        {"top_p": 0.5, "top_k": -1, "min_p": 0.1, "presence_penalty": -2, "frequency_penalty": 2,
         "repetition_penalty": 1.1, "min_tokens": 1, "stop": ["a", "b"], "stop_token_ids": [1, 2],
         "include_stop_str_in_output": True, "ignore_eos": True, "skip_special_tokens": False},
        {"prompt_logprobs": 1, "truncate_prompt_tokens": 3, "return_token_ids": True, "request_id": "r1", "user": "u"},
        {"response_format": {"type": "text"}, "logit_bias": {}, "allowed_token_ids": [], "reasoning_effort": "low"},
        {"chat_template_kwargs": {"thinking": False, "enable_thinking": True, "thinking_mode": "disabled"},
         "include_reasoning": False, "continue_final_message": True, "add_generation_prompt": False},
        {"documents": [{"title": "t", "text": "x"}], "n": 128, "best_of": 128, "temperature": 1e38},
    ]
    bodies += [dict({"messages": USER}, **e) for e in extra]
    return [compact(b) for b in bodies] + ['{"messages": []}', '{"messages": [{"content": "no role"}]}', "{not json",
                                          "[1]"]


def completion_bodies():
    bodies = [{"prompt": "abc"}, {"prompt": [1, 2]}, {"prompt": [[1], [2, 3]], "logprobs": 2, "echo": True},
              {"prompt": ["a", "b"], "max_tokens": None, "add_special_tokens": False, "suffix": ""},
              {"prompt": "a", "stream": True, "stream_options": {"include_usage": True}, "n": 3, "best_of": 3},
              {"prompt": "a", "stop": ["\n"], "seed": -1, "temperature": 0.7, "top_p": 0.9, "max_tokens": 16,
               "min_tokens": 2, "prompt_logprobs": 0, "logprobs": 20},
              {"prompt": [4294967296], "max_completion_tokens": 1}, {"prompt": ""}, {"prompt": [-1]}, {"prompt": [1.5]},
              {}]
    return [compact(b) for b in bodies]


REQUEST_WORDS = [
    "{", "}", "[", "]", ":", ",", '"', "\\u0000", "\\ud800", "true", "false", "null", "-0", "1e308", "-1", "0.5",
    "18446744073709551616", "9223372036854775807", "messages", "role", "content", "user", "assistant", "system",
    "tool", "developer", "name", "tool_calls", "tool_call_id", "function", "arguments", "type", "text", "image_url",
    "reasoning_content", "reasoning", "tools", "parameters", "properties", "description", "required", "tool_choice",
    "auto", "none", "chat_template_kwargs", "thinking", "enable_thinking", "thinking_mode", "documents",
    "add_generation_prompt", "continue_final_message", "model", "prompt", "max_tokens", "max_completion_tokens",
    "temperature", "top_p", "top_k", "min_p", "n", "best_of", "stop", "stop_token_ids", "seed", "stream",
    "stream_options", "include_usage", "logprobs", "top_logprobs", "prompt_logprobs", "echo", "response_format",
    "logit_bias", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "request_id",
    "truncate_prompt_tokens", "return_token_ids", "parallel_tool_calls", "include_reasoning", "reasoning_effort",
]

# ---- chat templates ----

JINJA_WORDS = [
    "{{", "}}", "{%", "%}", "{#", "#}", "{%-", "-%}", "{{-", "-}}", "if", "elif", "else", "endif", "for", "in",
    "endfor", "set", "endset", "macro", "endmacro", "call", "endcall", "filter", "endfilter", "generation",
    "endgeneration", "break", "continue", "not", "and", "or", "is", "defined", "none", "true", "false", "True",
    "False", "None", "loop", "loop.index", "loop.last", "namespace", "range", "raise_exception", "strftime_now",
    "tojson", "trim", "length", "join", "split", "replace", "startswith", "endswith", "items", "selectattr",
    "rejectattr", "map", "list", "string", "lower", "upper", "default", "first", "last", "sort", "unique",
    "indent", "|", ".", "(", ")", "[", "]", "~", "+", "*", "**", "//", "%", "==", "!=", "messages", "tools",
    "message", "message.content", "message.role", "add_generation_prompt", "bos_token", "'", '"', "\n",
]


def template_sources():
    sources = [(ROOT / "tests/data/templates" / f).read_text(encoding="utf-8")
               for f in ["kimi-k3.jinja", "kimi-k2.jinja", "kimi-k2-thinking.jinja", "deepseek-v3.2.jinja",
                         "minimax-m2.jinja", "minimax-m3.jinja"]]
    return sources + [s["template"] for s in load("tests/data/templates/snippets.json")]


def template_requests():
    conversations = load("tests/data/templates/conversations.json")
    return [bytes([i % TEMPLATE_COUNT]) + compact(c["request"]).encode() for i, c in enumerate(conversations)]


# ---- tokenizers ----

def tokenizer_texts():
    texts = load("tests/data/tokenizers/corpus.json")["texts"]
    rng = random.Random(20)
    picked = [t for t in rng.sample(texts, 80) if t]
    specials = ["<|im_end|>", "<think>", "</think>", "<｜begin▁of▁sentence｜>", "]~!b[", "[e~[", "<|im_user|>"]
    return picked + ["a" + s + "b" for s in specials]


def special_tokens():
    tokens = []
    for folder in ["models/kimi_k3", "models/minimax_m3", "models/deepseek_v32",
                   "tests/data/tokenizers/deepseek_v32", "tests/data/tokenizers/minimax_m3"]:
        tokens += [t["content"] for t in load(folder + "/tokenizer.json").get("added_tokens", [])]
    kimi = load("tests/data/tokenizers/kimi_linear/tokenizer_config.json")
    tokens += [t["content"] for t in kimi.get("added_tokens_decoder", {}).values()][:40]
    return tokens + ["\xa0", "\u3000", "\u200d", "👩🏻‍🔬", "é", "é", "１", "\r\n", "'s", "'ll"]


# ---- safetensors and checkpoints ----

def safetensors_file(tensors, metadata=None, pad=True):
    header = {"__metadata__": metadata} if metadata is not None else {}
    data = b""
    for name, dtype, shape, payload in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(payload)]}
        data += payload
    text = json.dumps(header, separators=(",", ":")).encode()
    if pad:
        text += b" " * ((8 - len(text) % 8) % 8)
    return struct.pack("<Q", len(text)) + text + data


def safetensors_seeds():
    f32 = struct.pack("<4f", 1.0, -2.5, 0.0, 3.0e38)
    return [
        safetensors_file([("w", "F32", [2, 2], f32)], {"format": "pt"}),
        safetensors_file([("a", "BF16", [3], b"\x80\x3f\x00\x40\x80\x7f"), ("b", "F16", [1, 2], b"\x00\x3c\x00\x7c"),
                          ("c", "F8_E4M3", [4], b"\x00\x7e\x7f\xff"), ("d", "F8_E8M0", [2], b"\x7f\xff")]),
        safetensors_file([("e", "I64", [1], b"\x01" * 8), ("f", "BOOL", [0], b""), ("g", "F32", [], f32[:4])],
                         pad=False),
        safetensors_file([("x", "U8", [2, 0, 3], b"")]),
        safetensors_file([]),
        struct.pack("<Q", 2) + b"{}",
    ]


def quantized_checkpoint_seeds():
    """One weight in each stored format of formats/quantization.h, well formed, and a few near misses."""
    e4m3 = bytes([0x38, 0x40, 0xB8, 0x00] * 16)           # 64 E4M3 codes
    e8m0 = bytes([127, 130])                                # two MX block scales
    fp4 = bytes([0x71, 0xA0] * 16)                           # 64 E2M1 values, packed
    return [
        safetensors_file([("b.weight", "F8_E4M3", [1, 64], e4m3), ("b.weight_scale_inv", "U8", [1, 2], e8m0)]),
        safetensors_file([("a.weight", "U8", [1, 32], fp4), ("a.weight_scale", "F8_E4M3", [1, 4], bytes([0x38] * 4)),
                          ("a.weight_scale_2", "F32", [], struct.pack("<f", 0.5)),
                          ("a.input_scale", "F32", [1], struct.pack("<f", 1.0))]),
        safetensors_file([("a.weight_packed", "U8", [1, 32], fp4), ("a.weight_scale", "F8_E8M0", [1, 2], e8m0)]),
        safetensors_file([("c.weight", "F8_E4M3", [1, 64], e4m3), ("c.weight_scale_inv", "F32", [1, 1],
                                                                     struct.pack("<f", 0.25))]),
        safetensors_file([("b.weight", "F8_E4M3", [1, 64], e4m3), ("b.weight_scale_inv", "U8", [2, 1], e8m0)]),
        safetensors_file([("a.weight", "U8", [1, 32], fp4), ("a.weight_scale", "F8_E4M3", [1, 4], bytes([0x38] * 4))]),
    ]


def index_seeds():
    index = load("tests/fixtures/deepseek_v32_fp8/model.safetensors.index.json")
    by_shard = {}
    for name, shard in index["weight_map"].items():
        by_shard.setdefault(shard, []).append(name)
    small = {name: shard for shard, names in sorted(by_shard.items()) for name in names[:2]}
    one_shard = {name: shard for name, shard in index["weight_map"].items() if shard == sorted(by_shard)[-1]}
    return [compact({"metadata": {"total_size": 1}, "weight_map": small}), compact({"weight_map": one_shard}),
            compact({"weight_map": {}}), compact({"weight_map": {"x": "missing.safetensors"}})]


def index_words():
    index = load("tests/fixtures/deepseek_v32_fp8/model.safetensors.index.json")
    shards = sorted(set(index["weight_map"].values()))
    return ["weight_map", "metadata", "total_size", "_scale_inv", ".weight", "model.layers.0.", "../", "/"] + shards


# ---- config.json ----

def config_files():
    paths = sorted(ROOT.glob("tests/fixtures/*/config.json")) + sorted(ROOT.glob("models/*/config.json")) + \
        sorted((ROOT / "bench/shapes").glob("*.json"))
    return [compact(json.loads(p.read_text(encoding="utf-8"))) for p in paths]


def config_words():
    words = []

    def walk(value):
        if isinstance(value, dict):
            for k, v in value.items():
                words.append(k)
                walk(v)
        elif isinstance(value, list):
            for v in value:
                walk(v)
        elif isinstance(value, str):
            words.append(value)

    for text in config_files():
        walk(json.loads(text))
    return ["{", "}", "[", "]", ":", ",", "null", "true", "false", "0", "-1", "1e30", "1.5",
            "9223372036854775808", "minimax_m3_vl", "minimax_m3_vl_text", "kimi_linear", "text_config"] + words


# ---- parsers ----

def parser_seeds(kind):
    vectors = load("tests/data/parsers/%s.json" % kind)
    seeds = []
    rng = random.Random(kind)
    for i, case in enumerate(vectors["cases"]):
        kwargs = case.get("chat_template_kwargs", {})
        thinking = not (kwargs.get("thinking") is False or kwargs.get("enable_thinking") is False or
                        kwargs.get("thinking_mode") == "disabled")
        flags = (case.get("reasoning_parser", True) and 1) | (case.get("tool_parser", True) and 2) | \
            (4 if thinking else 0) | (8 if case.get("prompt", "").rstrip().endswith(vectors["markup"][-1]) else 0)
        output = case["output"].encode("utf-8")
        # Split the output into deltas at a few character boundaries (0xFF between them).
        cuts = sorted(rng.sample(range(1, len(output)), min(3, max(0, len(output) - 1)))) if len(output) > 1 else []
        pieces, start = [], 0
        for cut in cuts:
            while cut < len(output) and (output[cut] & 0xC0) == 0x80:
                cut += 1
            pieces.append(output[start:cut])
            start = cut
        pieces.append(output[start:])
        seeds.append(bytes([flags]) + b"\xff".join(pieces))
    return seeds


def image_seeds():
    """The small test images (tests/data/images, tools/make_image_fixtures.py): each PNG layout and JPEG kind."""
    return [f.read_bytes() for f in sorted((ROOT / "tests" / "data" / "images").glob("*"))
            if f.suffix in (".png", ".jpg", ".webp") and f.stat().st_size <= 12000]


# PNG chunk types, JPEG markers (SOF0/SOF2, DHT, DQT, SOS, EOI, APP0/APP14 with their identifiers), WebP chunks.
IMAGE_WORDS = [b"\x89PNG\r\n\x1a\n", b"IHDR", b"PLTE", b"tRNS", b"IDAT", b"IEND", b"gAMA", b"\x00\x00\x00\x0dIHDR",
               b"\xff\xd8\xff", b"\xff\xc0", b"\xff\xc2", b"\xff\xc4", b"\xff\xdb", b"\xff\xda", b"\xff\xd9",
               b"\xff\xe0", b"JFIF\x00", b"\xff\xee", b"Adobe", b"\xff\xff", b"\x00\x00", b"RIFF", b"WEBP", b"VP8 ",
               b"VP8L", b"VP8X", b"ALPH", b"ANIM", b"ANMF"]


def parser_words(kind):
    vectors = load("tests/data/parsers/%s.json" % kind)
    return vectors["markup"] + vectors.get("soup", []) + ["{", "}", '"', ":", ",", "\n", "null", "true", "1.5", "\\",
                                                          b"\xff"]


def main():
    write_corpus("chat_request", chat_bodies())
    write_corpus("completion_request", completion_bodies())
    write_dict("request", "JSON syntax and the fields of the OpenAI request bodies", REQUEST_WORDS)
    write_corpus("chat_template", template_requests())
    write_corpus("template_source", template_sources())
    write_dict("jinja", "Jinja syntax, keywords, filters and the chat templates' variables", JINJA_WORDS)
    texts = tokenizer_texts()
    write_corpus("tokenizer_hf", [bytes([i % HF_TOKENIZER_COUNT]) + t.encode() for i, t in enumerate(texts)])
    write_corpus("tokenizer_tiktoken", texts)
    write_dict("tokenizer", "the test tokenizers' special tokens and hard characters", special_tokens())
    write_corpus("safetensors", safetensors_seeds())
    write_dict("safetensors", "safetensors header keys and dtypes",
               ["__metadata__", "dtype", "shape", "data_offsets", "F32", "F16", "BF16", "F8_E4M3", "F8_E8M0", "I64",
                "U8", "BOOL", "F64", "{", "}", "[", "]", ",", ":", '"', "18446744073709551615"])
    write_corpus("quantized_checkpoint", quantized_checkpoint_seeds())
    write_corpus("checkpoint_index", index_seeds())
    write_dict("checkpoint_index", "model.safetensors.index.json keys, shard files and tensor names", index_words())
    write_corpus("config", config_files())
    write_dict("config", "config.json keys and values of the fixture and bundled models", config_words())
    write_corpus("image", image_seeds())
    write_dict("image", "PNG chunk types, JPEG markers and WebP chunk types", IMAGE_WORDS)
    for kind in PARSERS:
        write_corpus("parser_" + kind, parser_seeds(kind))
        write_dict("parser_" + kind, "the %s output markup (tests/data/parsers/%s.json) and the delta separator 0xFF"
                   % (kind, kind), parser_words(kind))


if __name__ == "__main__":
    main()
