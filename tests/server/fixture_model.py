"""A servable test model: a reference fixture's weights (tests/fixtures/<family>, random, vocabulary of
256) with a small byte-level tokenizer and a chat template written here, so the server's text paths
run without a trained model. The tokenizer holds 240 single-byte tokens (ids 0-239: every byte but 16
control characters) and special tokens from id 240: <s>, </s> (the end of sequence), Kimi K2's
reasoning and tool-call markers, so that --reasoning-parser / --tool-call-parser kimi_k2 have their
markup in the vocabulary."""
from __future__ import annotations

import json
import os
from pathlib import Path

SPECIAL_TOKENS = ["<s>", "</s>", "<think>", "</think>", "<|tool_calls_section_begin|>",
                  "<|tool_calls_section_end|>", "<|tool_call_begin|>", "<|tool_call_argument_begin|>",
                  "<|tool_call_end|>"]
EOS_ID = 241

# Role markers are plain text; tools are declared as JSON, as Kimi K2's template does.
CHAT_TEMPLATE = (
    "{%- if tools %}<|tools|>{{ tools | tojson }}\n{% endif -%}"
    "{%- for m in messages %}<|{{ m.role }}|>{{ m.content if m.content is string else '' }}\n{% endfor -%}"
    "{%- if add_generation_prompt %}<|assistant|>{% endif -%}")


def byte_level_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map, as tokenizers' ByteLevel uses it."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def tokenizer_json() -> dict:
    alphabet = byte_level_alphabet()
    left_out = set(range(0x00, 0x09)) | set(range(0x0E, 0x15))  # control bytes no test text uses
    vocab = {alphabet[b]: i for i, b in enumerate(b for b in range(256) if b not in left_out)}
    added = [{"id": len(vocab) + i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True} for i, t in enumerate(SPECIAL_TOKENS)]
    return {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                              "use_regex": True},
            "post_processor": None,
            "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
            "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                      "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                      "ignore_merges": False, "vocab": vocab, "merges": []}}


def make_test_model(fixture: Path, out: Path) -> Path:
    """Writes the model folder `out` from the fixture folder (weights linked, not copied)."""
    out.mkdir(parents=True, exist_ok=True)
    for name in os.listdir(fixture):
        if name.endswith(".safetensors") and name != "reference.safetensors" or name.endswith(".index.json") \
                or name == "config.json":
            (out / name).symlink_to(fixture.resolve() / name)
    (out / "tokenizer.json").write_text(json.dumps(tokenizer_json()))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "add_bos_token": False, "chat_template": CHAT_TEMPLATE}))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": EOS_ID}))
    return out
