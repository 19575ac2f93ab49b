#!/usr/bin/env python3
"""Writes tests/fixtures/minimax_m3_vl/tokenizer.json and tokenizer_config.json: a tokenizer for the 256-token
fixture, so that the server can serve it (chat template, image parts). Byte-level BPE without merges: the
newline and the printable ASCII bytes first (ids 0-95), then other bytes up to id 239 (HF tokenizers renumbers
added tokens after a gap, so the ids run without one), and MiniMax-M3's special tokens at the top of the
vocabulary, the image placeholder at the fixture's image_token_index (250) and the video one at its
video_token_index (251); the start / end of image tokens vLLM 0.33.0 wraps each image's placeholders in
(models/minimax_m3/common/mm_preprocess.py) beside them. The chat template is the bundled model's (MiniMax-M3's).

    python3 tools/make_minimax_vl_tokenizer.py
"""
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "minimax_m3_vl"
BUNDLED = ROOT / "models" / "minimax_m3"

SPECIAL = {240: "]!p~[", 241: "]!d~[", 242: "]~!b[", 243: "]~b]", 244: "[e~[", 245: "]<]minimax[>[",
           246: "<mm:think>", 247: "</mm:think>", 248: "]<]start of image[>[", 249: "]<]end of image[>[",
           250: "]<]image[>[", 251: "]<]video[>["}


def byte_symbol(b):
    """GPT-2's printable stand-in for a byte (bytes_to_unicode)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    if b in printable:
        return chr(b)
    return chr(256 + sorted(set(range(256)) - set(printable)).index(b))


def main():
    bundled = json.loads((BUNDLED / "tokenizer.json").read_text())
    first = [10] + list(range(32, 127))
    others = [b for b in range(256) if b not in first]
    vocab = {byte_symbol(b): i for i, b in enumerate((first + others)[:min(SPECIAL)])}
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [{"id": i, "content": c, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": True} for i, c in sorted(SPECIAL.items())],
        "normalizer": bundled["normalizer"],
        "pre_tokenizer": bundled["pre_tokenizer"],
        "post_processor": None,
        "decoder": bundled["decoder"],
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": []},
    }
    (FIXTURE / "tokenizer.json").write_text(json.dumps(tokenizer, indent=1, ensure_ascii=False) + "\n")
    config = json.loads((BUNDLED / "tokenizer_config.json").read_text())
    config["added_tokens_decoder"] = {str(i): {"content": c, "lstrip": False, "normalized": False, "rstrip": False,
                                               "single_word": False, "special": True} for i, c in SPECIAL.items()}
    (FIXTURE / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")

    from tokenizers import Tokenizer  # check: every id fits the fixture's vocabulary, the specials are whole
    t = Tokenizer.from_file(str(FIXTURE / "tokenizer.json"))
    ids = t.encode("]~b]user\nWhat is in ]<]image[>[ this picture?[e~[\n", add_special_tokens=False).ids
    assert max(ids) < 256 and 250 in ids and 243 in ids, ids
    print(f"{len(vocab)} byte tokens, {len(SPECIAL)} special; sample {ids}")


if __name__ == "__main__":
    main()
